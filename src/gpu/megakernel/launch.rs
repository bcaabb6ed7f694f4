//! Launching decode steps: a cooperative launch of one CTA per SM, running one step or a
//! generation (many greedy steps in one launch, handing each token to the host through mapped
//! memory as soon as it exists), and the epoch (tag) bookkeeping between launches.

use std::ffi::c_void;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{self, CUlaunchAttributeID};

use super::abi::{self, MkParams, THREADS};
use super::MegakernelPath;
use crate::gpu::stepping::GenerationRun;

/// The most stop tokens a generation checks on the device.
pub const MAX_STOP_TOKENS: usize = 16;

/// A mapped token word the device has not written yet.
const UNSET: u32 = u32::MAX;

/// Tags are epoch + 1 in 32 bits: before they would wrap, the tagged arena is cleared and the
/// epoch restarts.
pub const MAX_EPOCH: u32 = u32::MAX - 1;
// The restart keeps the meta slot's parity (see `launch_steps`).
const _: () = assert!(MAX_EPOCH.is_multiple_of(2));

/// Steps the next launch of a generation runs: the `left` still wanted, at most `per_launch`;
/// up to the end of the context bucket at `pos` (`bucket_end`: the longest sequence it runs,
/// `None` for the last bucket, which runs every longer one too), so the next launch can run
/// the next bucket's streams; and up to the tag's wrap (epoch + steps <= MAX_EPOCH), where the
/// next launch restarts the epoch. At least one step.
pub(super) fn launch_size(
    left: usize,
    per_launch: usize,
    pos: usize,
    bucket_end: Option<usize>,
    epoch: u32,
) -> usize {
    let to_bucket_end = bucket_end.map_or(usize::MAX, |end| end.saturating_sub(pos));
    let to_wrap = (MAX_EPOCH - epoch.min(MAX_EPOCH)) as usize;
    let steps = left
        .min(per_launch)
        .min(to_bucket_end)
        .min(MAX_EPOCH as usize / 2);
    // At the wrap itself the launch restarts the epoch first (launch_steps).
    let steps = if to_wrap > 0 {
        steps.min(to_wrap)
    } else {
        steps
    };
    steps.max(1)
}

/// Whether a launch whose first step has tag `first` must clear the in-launch draw's key
/// slots, the last such launch's first step having had tag `last_first` (0: none since the
/// slots were cleared): a slot's short tag repeats every `abi::SMP_SLOT_PERIOD` steps, and a
/// slot holds a tag no older than `last_first`. Tags are compared by distance (the epoch may
/// restart, clearing the slots with the arena).
fn draw_slots_stale(first: u32, last_first: u32) -> bool {
    last_first != 0 && first.wrapping_sub(last_first) >= abi::SMP_SLOT_PERIOD - 1
}

// The short tag (tag % period + 1, never 0) fits the 14 bits the slots keep for it.
const _: () = assert!(abi::SMP_SLOT_PERIOD < 1 << 14);

impl MegakernelPath<'_> {
    pub(super) fn launch(&mut self) -> Result<()> {
        self.launch_steps(1)?;
        self.params.epoch += 1;
        self.next_pos += 1;
        Ok(())
    }

    /// Enqueues one launch of `steps` steps from the meta's token at `next_pos` (the caller
    /// advances the epoch and the position by the steps that ran). The steps must stay within
    /// one context bucket.
    fn launch_steps(&mut self, steps: u32) -> Result<()> {
        self.select_bucket(self.next_pos);
        if u64::from(self.params.epoch) + u64::from(steps) > u64::from(MAX_EPOCH) {
            // The tag would wrap: restart with every tag cleared, so no old tag matches a
            // restarted one. The restart keeps the epoch's parity, so the step reads the same
            // meta slot (the one the last step's argmax wrote).
            self.gpu.stream.memset_zeros(&mut self.arena)?;
            self.gpu.stream.memset_zeros(&mut self.gen)?;
            self.params.epoch &= 1;
            self.slots_first = 0;
        }
        if self.params.sampling != 0 {
            self.fresh_draw_slots()?;
        }
        self.params.steps = steps;
        // SAFETY: CUlaunchAttribute is a plain C struct (an id and a union of integers and
        // structs of integers) for which all-zero bytes are a valid value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: self.gpu.sm_count as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.smem,
            hStream: self.gpu.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut args = [&self.params as *const MkParams as *mut c_void];
        // SAFETY: one argument, the MkParams struct the kernel declares, by value (its layout is
        // checked against the CUDA struct at compile time, see abi::checks); every pointer in it
        // addresses a buffer this path owns, alive as long as `self`.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.kernel_fn()?,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result();
        self.params.steps = 1;
        r.context("launching the megakernel (co-residency of one CTA per SM is required)")?;
        Ok(())
    }

    /// Up to `n` greedy steps from the token meta (the token at `next_pos`), in launches of
    /// up to `per_launch` steps. A launch runs step after step on the device and ends after a
    /// token of `stop`, at the host's request, or after its steps; it also ends where the
    /// sequence enters the next context bucket or the tag would wrap, and the next launch goes
    /// on from there. Each token is published to mapped host memory as soon as the step has
    /// it, and handed to `on` while the GPU computes the next; `on` returns whether to go on,
    /// and false or an error asks the running launch to stop (within a step).
    pub fn generate(
        &mut self,
        n: usize,
        per_launch: usize,
        stop: &[u32],
        on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<GenerationRun> {
        if stop.len() > MAX_STOP_TOKENS {
            bail!(
                "{} stop tokens; a generation on the GPU checks at most {MAX_STOP_TOKENS}",
                stop.len()
            );
        }
        if self.next_pos + n > self.seq.max_seq {
            bail!(
                "a generation of {n} tokens from position {} passes the context of {} tokens",
                self.next_pos,
                self.seq.max_seq
            );
        }
        if !stop.is_empty() {
            let mut dst = self.stop_ids.slice_mut(0..stop.len());
            self.gpu.stream.memcpy_htod(stop, &mut dst)?;
        }
        self.params.n_stop = stop.len() as u32;
        let vocab = self.model.config.vocab_size as u32;
        let mut run = GenerationRun {
            handled: 0,
            ran: 0,
            last: None,
        };
        let mut failure: Option<anyhow::Error> = None;
        let mut go_on = true;
        while go_on && run.ran < n {
            let pos = self.next_pos;
            // The last bucket runs every longer sequence too.
            let b = self.bucket_at(pos);
            let bucket_end = (b + 1 < self.buckets.len()).then(|| self.buckets[b].upto);
            let steps = launch_size(n - run.ran, per_launch, pos, bucket_end, self.params.epoch);
            let io = &self.gen_io;
            io.write(0, 0);
            for i in 0..steps {
                io.write(1 + i, UNSET);
            }
            self.params.gen_ctl = io.device_ptr();
            self.params.gen_out = io.device_ptr() + 4;
            let launched = self.launch_steps(steps as u32);
            self.params.gen_ctl = 0;
            self.params.gen_out = 0;
            launched?;
            let done = self.gpu.stream.record_event(None)?;
            let io = &self.gen_io;
            let mut got = 0;
            let mut idle = 0u32;
            while got < steps {
                let t = io.read(1 + got);
                if t == UNSET {
                    // Finished without publishing this step: stopped early, or failed. The
                    // event is a driver call, so it is asked only every so many empty polls.
                    idle = idle.wrapping_add(1);
                    if idle.is_multiple_of(64) && done.is_complete() && io.read(1 + got) == UNSET {
                        break;
                    }
                    if go_on && crate::interrupt::stop_pending() {
                        // Ctrl-C: the kernel stops after the step it is on.
                        io.write(0, 1);
                    }
                    std::hint::spin_loop();
                    continue;
                }
                got += 1;
                idle = 0;
                if !go_on {
                    continue;
                }
                if t >= vocab {
                    let chooser = if self.params.sampling != 0 {
                        "sampler"
                    } else {
                        "argmax"
                    };
                    failure = Some(crate::gpu::stepping::out_of_vocabulary(chooser, t));
                } else {
                    run.handled += 1;
                    run.last = Some(t);
                    match on(t) {
                        Ok(true) => continue,
                        Ok(false) => {}
                        Err(e) => failure = Some(e),
                    }
                }
                go_on = false;
                io.write(0, 1);
            }
            done.synchronize()?;
            self.params.epoch += got as u32;
            self.next_pos += got;
            run.ran += got;
            if got < steps {
                // Stopped on the device (a stop token) or failed: the error word says which.
                go_on = false;
            }
        }
        self.params.n_stop = 0;
        self.check_error()?;
        match failure {
            Some(e) => Err(e),
            None => Ok(run),
        }
    }

    fn kernel_fn(&self) -> Result<sys::CUfunction> {
        let i = self.streams().kernel;
        if self.params.sampling == 0
            && !(self.greedy_on_sampled && self.sampled_kernels[i].is_some())
        {
            return Ok(self.kernels[i].1.cu_function());
        }
        match &self.sampled_kernels[i] {
            Some((_, k)) => Ok(k.cu_function()),
            None => {
                bail!("megakernel: a sampled launch before prepare_sampling compiled its kernel")
            }
        }
    }

    /// Before a launch that draws inside it: the draw polls each key slot for its step's short
    /// tag (megakernel/ops/sample.cuh, `smp_slot_word`), which repeats every
    /// `abi::SMP_SLOT_PERIOD` steps. Every such launch's steps rewrite every slot, so a slot
    /// holds a tag no older than the last such launch's first step; where that is a period or
    /// more before this launch's first step, the slots are cleared (a cleared slot never
    /// passes).
    fn fresh_draw_slots(&mut self) -> Result<()> {
        let first = self.params.epoch + 1;
        if draw_slots_stale(first, self.slots_first) {
            let at = self.streams().arena.offset("lm_sample") + scheduler::arena::SAMPLE_GATE_WORDS;
            let n = self.params.n_lm as usize * scheduler::arena::SAMPLE_BLOCK_WORDS;
            let mut slots = self.arena.slice_mut(at..at + n);
            self.gpu.stream.memset_zeros(&mut slots)?;
        }
        self.slots_first = first;
        Ok(())
    }

    /// Makes the next step run at `epoch` (tag `epoch + 1`), as if that many steps had run
    /// before: tests use it to cross the tag's wrap-around in a few steps. Clears the tags and
    /// keeps the token meta the next step reads.
    #[doc(hidden)]
    pub fn set_epoch_for_test(&mut self, epoch: u32) -> Result<()> {
        self.gpu.stream.memset_zeros(&mut self.arena)?;
        self.gpu.stream.memset_zeros(&mut self.gen)?;
        self.slots_first = 0;
        if (epoch ^ self.params.epoch) & 1 == 1 {
            // Step e reads meta slot e % 2: the slots trade places with the parity.
            let m = self.gpu.stream.clone_dtoh(&self.meta)?;
            let swapped: Vec<u32> = m[4..8].iter().chain(&m[0..4]).copied().collect();
            self.gpu.stream.memcpy_htod(&swapped, &mut self.meta)?;
        }
        self.params.epoch = epoch.min(MAX_EPOCH);
        Ok(())
    }

    /// The epoch of the next step.
    pub fn epoch(&self) -> u32 {
        self.params.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::{draw_slots_stale, launch_size, MAX_EPOCH};
    use crate::gpu::megakernel::abi::SMP_SLOT_PERIOD;

    #[test]
    fn the_draw_slots_are_cleared_a_tag_period_after_the_last_sampled_launch() {
        // None since the slots were cleared: nothing old to mistake.
        assert!(!draw_slots_stale(1, 0));
        assert!(!draw_slots_stale(5_000_000, 0));
        // One launch a token, or a generation shorter than the period.
        assert!(!draw_slots_stale(101, 100));
        assert!(!draw_slots_stale(100 + SMP_SLOT_PERIOD - 2, 100));
        // A period (less the margin of one) or more since: cleared.
        assert!(draw_slots_stale(100 + SMP_SLOT_PERIOD - 1, 100));
        assert!(draw_slots_stale(100 + 3 * SMP_SLOT_PERIOD, 100));
        // By distance across the u32 wrap of the tags.
        assert!(!draw_slots_stale(10, u32::MAX - 5));
    }

    #[test]
    fn a_generation_launch_stops_at_its_budget_the_bucket_end_and_the_wrap() {
        // The whole generation when nothing stops it.
        assert_eq!(launch_size(400, usize::MAX, 39, None, 0), 400);
        // Launches of per_launch steps.
        assert_eq!(launch_size(400, 7, 39, None, 0), 7);
        assert_eq!(launch_size(5, 7, 39, None, 0), 5);
        // A bucket of sequences up to 256 long: positions 39..=255 (lengths 40..=256).
        assert_eq!(launch_size(400, usize::MAX, 39, Some(256), 0), 217);
        assert_eq!(launch_size(400, usize::MAX, 255, Some(256), 0), 1);
        // Past a bucket's end (never chosen for it, but never zero steps).
        assert_eq!(launch_size(400, usize::MAX, 300, Some(256), 0), 1);
        // The tag's wrap: tags epoch + 1 ..= epoch + steps stay at most MAX_EPOCH.
        assert_eq!(launch_size(15, usize::MAX, 0, None, MAX_EPOCH - 8), 8);
        assert_eq!(launch_size(15, usize::MAX, 0, None, MAX_EPOCH - 1), 1);
        // At the wrap the launch restarts the epoch before it runs.
        assert_eq!(launch_size(15, usize::MAX, 0, None, MAX_EPOCH), 15);
        // Every limit at once: the smallest wins.
        assert_eq!(launch_size(100, 50, 240, Some(256), MAX_EPOCH - 30), 16);
    }
}
