//! Launching decode steps: a cooperative launch of one CTA per SM running one step or many
//! (each step's token published to mapped host memory as it is drawn), and the epoch (tag)
//! bookkeeping between launches.

use std::ffi::c_void;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{self, CUlaunchAttributeID};

use super::abi::{MkParams, MAX_STOP_IDS, THREADS};
use super::MegakernelPath;
use crate::sampling::SamplingParams;

/// A token's flag in the mapped token list (`MK_TOKEN_READY`): an entry not yet written is 0.
const TOKEN_READY: u32 = 0x8000_0000;

/// Pinned host memory mapped into the device's address space (`cuMemHostAlloc` with
/// `DEVICEMAP`): the kernel's stores reach the host without a copy, and the host's reach the
/// kernel. Words: `[0]` the stop flag the host writes, `[1..]` the tokens of a launch.
pub(super) struct Mapped {
    host: *mut u32,
    dev: u64,
    words: usize,
}

impl Mapped {
    fn new(gpu: &crate::gpu::device::Gpu, words: usize) -> Result<Self> {
        gpu.ctx.bind_to_thread()?;
        let bytes = words * 4;
        // SAFETY: a fresh allocation of `bytes` (not write-combined: the host reads it), zeroed
        // below before any use; the device pointer is the same allocation's mapping.
        unsafe {
            let host = cudarc::driver::result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP)
                .context("allocating mapped pinned host memory (cuMemHostAlloc DEVICEMAP)")?
                as *mut u32;
            std::ptr::write_bytes(host, 0, words);
            let mut dev: sys::CUdeviceptr = 0;
            if let Err(e) =
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0).result()
            {
                let _ = cudarc::driver::result::free_host(host as *mut c_void);
                return Err(e).context(
                    "mapping pinned host memory into the device (cuMemHostGetDevicePointer)",
                );
            }
            Ok(Self { host, dev, words })
        }
    }

    fn read(&self, i: usize) -> u32 {
        assert!(i < self.words);
        // SAFETY: in bounds of the live allocation; volatile, since the device writes it.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    fn write(&self, i: usize, v: u32) {
        assert!(i < self.words);
        // SAFETY: as in `read`.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `new`; the path syncs its stream before it drops
        // (no kernel still writes here).
        unsafe {
            let _ = cudarc::driver::result::free_host(self.host as *mut c_void);
        }
    }
}

/// Why a generation on the device ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainStop {
    /// The token budget.
    Budget,
    /// A token of the stop list (eos), which is the last of the tokens.
    StopToken,
    /// The host's stop flag (Ctrl-C).
    Interrupted,
}

/// The result of [`MegakernelPath::generate_chained`].
#[derive(Debug, Clone)]
pub struct ChainRun {
    pub tokens: Vec<u32>,
    pub stop: ChainStop,
    pub launches: usize,
}

/// Tags are epoch + 1 in 32 bits: before they would wrap, the tagged arena is cleared and the
/// epoch restarts.
pub const MAX_EPOCH: u32 = u32::MAX - 1;
// The restart keeps the meta slot's parity (see `launch`).
const _: () = assert!(MAX_EPOCH.is_multiple_of(2));

impl MegakernelPath<'_> {
    /// One greedy step (the streams end with `Argmax`).
    pub(super) fn launch(&mut self) -> Result<()> {
        self.launch_steps(1, false)
    }

    /// One sampled step, with the parameters of [`Self::set_sampling`].
    pub(super) fn launch_sampled(&mut self) -> Result<()> {
        if self.sampling.is_none() {
            bail!("megakernel: sampled step before the sampling parameters were set");
        }
        self.launch_steps(1, true)
    }

    /// Makes `p` the parameters of the sampled steps launched next.
    pub fn set_sampling(&mut self, p: &SamplingParams) -> Result<()> {
        p.validate()?;
        self.params.smp = crate::sampling::device::param_words(p);
        self.sampling = Some(*p);
        Ok(())
    }

    /// Enqueues one launch of `steps` steps in the context bucket of the next position (at
    /// most `MAX_EPOCH - epoch` after a wrap, and no further than that bucket's last position
    /// ([`Self::steps_in_bucket`]); the caller keeps to both). The epoch and the next position
    /// advance by `steps`; a launch that stops early is corrected by
    /// [`Self::generate_chained`], which reads how many ran.
    fn launch_steps(&mut self, steps: u32, sample: bool) -> Result<()> {
        debug_assert!(steps as usize <= self.steps_in_bucket(self.next_pos));
        self.select_bucket(self.next_pos, sample);
        if self.params.epoch >= MAX_EPOCH {
            // The tag would wrap: restart at epoch 0 with every tag cleared, so no old tag
            // matches a restarted one. MAX_EPOCH is even, so epoch 0 reads the same meta slot
            // (the one the last step's argmax wrote) as epoch MAX_EPOCH would have.
            self.gpu.stream.memset_zeros(&mut self.arena)?;
            self.params.epoch = 0;
        }
        debug_assert!(steps >= 1 && steps <= MAX_EPOCH - self.params.epoch);
        self.params.steps = steps;
        self.params.sample = sample as u32;
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
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.kernel_fn(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .context("launching the megakernel (co-residency of one CTA per SM is required)")?;
        self.params.epoch += steps;
        self.next_pos += steps as usize;
        Ok(())
    }

    fn kernel_fn(&self) -> sys::CUfunction {
        self.kernel.cu_function()
    }

    /// Makes the next step run at `epoch` (tag `epoch + 1`), as if that many steps had run
    /// before: tests use it to cross the tag's wrap-around in a few steps. Clears the tags and
    /// keeps the token meta the next step reads.
    #[doc(hidden)]
    pub fn set_epoch_for_test(&mut self, epoch: u32) -> Result<()> {
        self.gpu.stream.memset_zeros(&mut self.arena)?;
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

impl MegakernelPath<'_> {
    /// `n` steps from `token` (fed at the sequence's next position) chained on the device, in
    /// launches of [`Self::tokens_per_launch`] steps (0: one launch), greedy or, with a
    /// `sampler` whose parameters are not greedy, drawn by it inside the launch (its context
    /// ends with `token`). The kernel ends a launch after a token of `stop` (which is the last
    /// of the tokens), at the budget, or after the step during which `interrupt()` turned true
    /// (the host then writes the stop flag the kernel reads each step). `on_token` gets every
    /// token as soon as it is in the mapped token list, while the GPU computes the next ones.
    pub fn generate_chained(
        &mut self,
        token: u32,
        n: usize,
        sampler: Option<&crate::sampling::Sampler>,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> Result<()>,
        interrupt: &dyn Fn() -> bool,
    ) -> Result<ChainRun> {
        let sampler = sampler.filter(|s| !s.params().is_greedy());
        match sampler {
            Some(sp) => {
                self.set_sampling(sp.params())?;
                crate::gpu::stepping::begin_sampled_chain(self, sp, token, n)?;
            }
            None => crate::gpu::stepping::begin_greedy_chain(self, token, n)?,
        }
        if stop.len() > MAX_STOP_IDS {
            bail!(
                "{} stop tokens; the megakernel takes at most {MAX_STOP_IDS}",
                stop.len()
            );
        }
        self.params.stop_ids = [0; MAX_STOP_IDS];
        self.params.stop_ids[..stop.len()].copy_from_slice(stop);
        self.params.n_stop = stop.len() as i32;
        let per = match self.tokens_per_launch {
            0 => n,
            k => k.min(n),
        }
        .max(1);
        if self.mapped.as_ref().is_none_or(|m| m.words < per + 1) {
            self.gpu.stream.synchronize()?;
            self.mapped = Some(Mapped::new(self.gpu, per + 1)?);
        }
        let vocab = self.model.config.vocab_size as u32;
        let mut out: Vec<u32> = Vec::with_capacity(n);
        let mut launches = 0;
        let mut flagged = false;
        let mut callback_err: Option<anyhow::Error> = None;
        let mut reason = ChainStop::Budget;
        while out.len() < n {
            // A launch never crosses the tag's wrap: it ends at MAX_EPOCH, where the next
            // launch clears the arena (launch_steps). Nor a context bucket's end: its steps run
            // one set of streams, and the next launch selects the next bucket's.
            let epoch = if self.params.epoch >= MAX_EPOCH {
                0
            } else {
                self.params.epoch
            };
            let steps = (n - out.len())
                .min(per)
                .min((MAX_EPOCH - epoch) as usize)
                .min(self.steps_in_bucket(self.next_pos)) as u32;
            let mapped = self.mapped.as_ref().expect("allocated above");
            for i in 0..=steps as usize {
                mapped.write(i, 0);
            }
            mapped.write(0, flagged as u32);
            self.params.host_stop = mapped.dev;
            self.params.host_tokens = mapped.dev + 4;
            let launched = self.launch_steps(steps, sampler.is_some());
            self.params.host_stop = 0;
            self.params.host_tokens = 0;
            launched?;
            let epoch0 = self.params.epoch - steps;
            let pos0 = self.next_pos - steps as usize;
            launches += 1;
            let mapped = self.mapped.as_ref().expect("allocated above");
            let mut streamed: Vec<u32> = Vec::with_capacity(steps as usize);
            let mut take = |streamed: &mut Vec<u32>, v: u32, cb_err: &mut Option<anyhow::Error>| {
                let t = v & !TOKEN_READY;
                streamed.push(t);
                if t < vocab && cb_err.is_none() {
                    if let Err(e) = on_token(t) {
                        *cb_err = Some(e);
                    }
                }
            };
            loop {
                while streamed.len() < steps as usize {
                    let v = mapped.read(1 + streamed.len());
                    if v & TOKEN_READY == 0 {
                        break;
                    }
                    take(&mut streamed, v, &mut callback_err);
                }
                if !flagged && (callback_err.is_some() || interrupt()) {
                    mapped.write(0, 1);
                    flagged = true;
                }
                // SAFETY: a query of this path's live stream.
                match unsafe { sys::cuStreamQuery(self.gpu.stream.cu_stream()) } {
                    sys::CUresult::CUDA_SUCCESS => break,
                    sys::CUresult::CUDA_ERROR_NOT_READY => std::thread::yield_now(),
                    e => {
                        e.result().context("waiting for the megakernel")?;
                    }
                }
            }
            self.gpu.stream.synchronize()?;
            self.check_error()?;
            let ran = self.gpu.stream.clone_dtoh(&self.run_info.slice(0..1))?[0];
            if ran == 0 || ran > steps {
                bail!("megakernel: a launch of {steps} steps reports {ran} steps run");
            }
            self.params.epoch = epoch0 + ran;
            self.next_pos = pos0 + ran as usize;
            // Everything the kernel published is visible now that it has ended.
            while streamed.len() < ran as usize {
                let v = mapped.read(1 + streamed.len());
                if v & TOKEN_READY == 0 {
                    bail!(
                        "megakernel: step {} of the launch published no token",
                        streamed.len()
                    );
                }
                take(&mut streamed, v, &mut callback_err);
            }
            let start = self.seq.pos;
            self.seq.pos += ran as usize;
            let got = self
                .gpu
                .stream
                .clone_dtoh(&self.history.slice(start + 1..start + 1 + ran as usize))?;
            if let Some(bad) = got.iter().find(|&&t| t >= vocab) {
                bail!("megakernel produced token {bad} outside the vocabulary (NaN logits?)");
            }
            if got[..] != streamed[..ran as usize] {
                bail!("megakernel: the tokens published to the host differ from its history");
            }
            out.extend_from_slice(&got);
            if let Some(e) = callback_err {
                self.seq.meta_current = out.last().copied();
                return Err(e);
            }
            if stop.contains(out.last().expect("at least one step ran")) {
                reason = ChainStop::StopToken;
                break;
            }
            if flagged {
                reason = ChainStop::Interrupted;
                break;
            }
            if ran < steps {
                bail!("megakernel: a launch stopped after {ran} of {steps} steps without a stop token or flag");
            }
        }
        self.seq.meta_current = out.last().copied();
        if sampler.is_some() {
            self.seq.history_synced = true;
        }
        Ok(ChainRun {
            tokens: out,
            stop: reason,
            launches,
        })
    }
}
