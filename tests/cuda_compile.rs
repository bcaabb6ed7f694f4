//! The CUDA sources compile with NVRTC for Hopper. Needs only libnvrtc, not a GPU; skipped
//! (with a message) where NVRTC is absent, as on CI.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::skip_notice;

use megainfer::gpu::{compile, sources};
use megainfer::model::presets;

fn nvrtc_or_skip() -> bool {
    if compile::nvrtc_present() {
        return true;
    }
    skip_notice("libnvrtc not found; CUDA sources not compiled");
    false
}

#[test]
fn baseline_kernels_compile_for_sm90a() {
    if !nvrtc_or_skip() {
        return;
    }
    let cubin = compile::compile_cubin("baseline", &sources::baseline(), "sm_90a", &[]).unwrap();
    assert_eq!(
        &cubin[..4],
        b"\x7fELF",
        "NVRTC output is not a CUBIN (ELF) image"
    );
}

#[test]
fn megakernel_compiles_for_sm90a() {
    if !nvrtc_or_skip() {
        return;
    }
    // Each attention shape the GPU paths support: head_dim 64 and 128, 1 to 9 query heads
    // per KV head (more than one pass of four).
    for (hd, group) in [(64, 4), (64, 3), (128, 2), (64, 9), (128, 1)] {
        let mut cfg = presets::by_name("smollm2-135m").unwrap();
        cfg.head_dim = hd;
        cfg.num_kv_heads = 1;
        cfg.num_heads = group;
        let defines = sources::megakernel_defines(&cfg);
        let cubin =
            compile::compile_cubin("megakernel", &sources::megakernel(), "sm_90a", &defines)
                .unwrap();
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "NVRTC output is not a CUBIN (ELF) image (head_dim {hd}, group {group})"
        );
    }
}

#[test]
fn nvrtc_errors_carry_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = compile::compile_cubin(
        "broken",
        "extern \"C\" __global__ void k() { int x = ; }",
        "sm_90a",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("NVRTC failed to compile broken"), "{err}");
    assert!(err.contains("expected an expression"), "{err}");
}

#[test]
fn prefill_kernels_compile_for_sm90a() {
    if !nvrtc_or_skip() {
        return;
    }
    let cubin =
        compile::compile_cubin("prefill", megainfer::gpu::prefill::SOURCE, "sm_90a", &[]).unwrap();
    assert_eq!(
        &cubin[..4],
        b"\x7fELF",
        "NVRTC output is not a CUBIN (ELF) image"
    );
}
