use megainfer::gpu::compile::compile_cubin;
use megainfer::gpu::sources;

#[test]
fn kcubins() {
    use megainfer::gpu::megakernel::{
        down_chunk_cols, kernel_defines, megakernel_gpu_shape, megakernel_schedule, KernelSpec,
    };
    let tag = std::env::var("X_TAG").unwrap_or("x".into());
    let presets = std::env::var("X_PRESETS").unwrap_or("llama-3.2-1b".into());
    for name in presets.split_whitespace() {
        let cfg = megainfer::model::presets::by_name(name).unwrap();
        let shape = megakernel_gpu_shape(&cfg, 132, 232_448);
        let cost = scheduler::CostModel::megakernel(64);
        let sched = megakernel_schedule(&cfg, &shape, &cost, &Default::default()).unwrap();
        let spec = KernelSpec {
            formats: {
                let q: i32 = std::env::var("X_WT")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                sources::MatrixFormats {
                    qkv: q,
                    o: q,
                    gate_up: q,
                    down: q,
                    lm_head: q,
                    embed: q,
                }
            },
            down_cols: down_chunk_cols(&sched),
            down_chunks: sched.options.down_chunks,
            attn_by_warps: std::env::var("X_BYWARPS").is_ok(),
            sampled: std::env::var("X_SAMPLED").is_ok(),
            freq_in_smem: std::env::var("X_NOFREQ").is_err(),
        };
        let extra = std::env::var("X_DEFINES").unwrap_or_default();
        let d = kernel_defines(&cfg, &spec, &extra);
        std::fs::write("/tmp/mk.cu", sources::megakernel()).unwrap();
        let r = compile_cubin("megakernel", &sources::megakernel(), "sm_90a", &d);
        match r {
            Ok(c) => {
                std::fs::write(format!("/tmp/k-{tag}-{name}.cubin"), &c).unwrap();
                println!("{name}: {} bytes", c.len());
            }
            Err(e) => panic!("{name}: {e:#}"),
        }
    }
}
