//! `cargo bench --bench decode_paths`: greedy decode on every GPU path (megakernel, graph with
//! PDL, graph, eager) with random weights of the SmolLM2-135M and Llama-3.2-1B shapes, 64
//! tokens per sample after a 4-token prompt. Without a GPU it prints a notice and measures
//! nothing (`megainfer bench` gives the fuller report: bandwidth, percentiles, profile).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megainfer::generate::Backend;
use megainfer::gpu::device::Gpu;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::paths::{GpuPath, PathKind};
use megainfer::model::{presets, random::random_weights};
use megainfer::sampling::argmax;

const PROMPT: [u32; 4] = [1, 504, 3660, 314];
const DECODE: usize = 64;

fn decode_paths(c: &mut Criterion) {
    if !megainfer::gpu::available() {
        eprintln!("decode_paths: no CUDA GPU/driver on this machine; nothing measured");
        return;
    }
    let gpu = Gpu::new(0).expect("GPU present but could not be opened");
    for preset in ["smollm2-135m", "llama-3.2-1b"] {
        let cfg = presets::by_name(preset).unwrap();
        let w = random_weights(&cfg, 1);
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        let len = PROMPT.len() + DECODE;
        let mut group = c.benchmark_group(format!("decode {preset}"));
        group.sample_size(20);
        group.throughput(Throughput::Elements(DECODE as u64));
        for kind in PathKind::ALL {
            let mut path = GpuPath::new(kind, &gpu, &dm, len, len).unwrap();
            group.bench_function(kind.name(), |b| {
                b.iter_custom(|iters| {
                    let mut total = std::time::Duration::ZERO;
                    for _ in 0..iters {
                        path.reset();
                        let first = argmax(&path.feed(&PROMPT).unwrap());
                        // decode_greedy returns after reading the tokens back: the device
                        // is done when the clock stops.
                        let start = std::time::Instant::now();
                        std::hint::black_box(path.decode_greedy(first, DECODE).unwrap());
                        total += start.elapsed();
                    }
                    total
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, decode_paths);
criterion_main!(benches);
