//! Prints the megakernel's CUDA source as NVRTC compiles it: the files of `megakernel/` and
//! `kernels/` it is made of, joined in order (`megainfer::gpu::sources::megakernel`). A CUBIN
//! compiled with `MEGAINFER_MK_DEFINES=-lineinfo` names its lines by this text's line numbers;
//! `scripts/sass-by-source.py` maps them back to the files. Usage:
//!
//!   cargo run --release --example megakernel_source > megakernel.cu

fn main() {
    print!("{}", megainfer::gpu::sources::megakernel());
}
