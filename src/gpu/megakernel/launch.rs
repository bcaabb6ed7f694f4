//! Launching one decode step: a cooperative launch of one CTA per SM, and the epoch (tag)
//! bookkeeping between launches.

use std::ffi::c_void;

use anyhow::{Context, Result};
use cudarc::driver::sys::{self, CUlaunchAttributeID};

use super::abi::{MkParams, THREADS};
use super::MegakernelPath;

/// Tags are epoch + 1 in 32 bits: before they would wrap, the tagged arena is cleared and the
/// epoch restarts.
pub const MAX_EPOCH: u32 = u32::MAX - 1;
// The restart keeps the meta slot's parity (see `launch`).
const _: () = assert!(MAX_EPOCH.is_multiple_of(2));

impl MegakernelPath<'_> {
    pub(super) fn launch(&mut self) -> Result<()> {
        self.select_bucket(self.next_pos);
        if self.params.epoch >= MAX_EPOCH {
            // The tag would wrap: restart at epoch 0 with every tag cleared, so no old tag
            // matches a restarted one. MAX_EPOCH is even, so epoch 0 reads the same meta slot
            // (the one the last step's argmax wrote) as epoch MAX_EPOCH would have.
            self.gpu.stream.memset_zeros(&mut self.arena)?;
            self.params.epoch = 0;
        }
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
        self.params.epoch += 1;
        self.next_pos += 1;
        Ok(())
    }

    fn kernel_fn(&self) -> sys::CUfunction {
        self.kernels[self.streams().kernel].1.cu_function()
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
