//! `cargo bench --bench cpu_reference`: the CPU reference forward's decode speed on the
//! SmolLM2-135M shape (random bf16 weights), one token per step after a 4-token prompt.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megainfer::model::{presets, random::random_weights};
use megainfer::reference::CpuForward;

const PROMPT: [u32; 4] = [1, 504, 3660, 314];
const DECODE: usize = 4;

fn decode_tokens_per_s(c: &mut Criterion) {
    let cfg = presets::by_name("smollm2-135m").unwrap();
    let w = random_weights(&cfg, 1);
    let mut group = c.benchmark_group("cpu reference smollm2-135m");
    group.sample_size(10);
    group.throughput(Throughput::Elements(DECODE as u64));
    group.bench_function(format!("decode {DECODE} tokens"), |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            for _ in 0..iters {
                let mut cpu = CpuForward::new(&cfg, &w, PROMPT.len() + DECODE);
                cpu.forward(&PROMPT).unwrap();
                let start = std::time::Instant::now();
                for k in 0..DECODE as u32 {
                    std::hint::black_box(cpu.forward(&[k + 7]).unwrap());
                }
                total += start.elapsed();
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, decode_tokens_per_s);
criterion_main!(benches);
