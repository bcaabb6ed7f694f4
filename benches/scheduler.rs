//! `cargo bench --bench scheduler`: time to build the megakernel's schedule for each preset
//! shape, on an H100's 132 SMs with the default cost model.

use criterion::{criterion_group, criterion_main, Criterion};
use scheduler::{CostModel, GpuShape, ModelShape, Options, PRESETS};

fn build_per_preset(c: &mut Criterion) {
    let gpu = GpuShape::h100();
    let mut group = c.benchmark_group("schedule build");
    for &name in PRESETS {
        let shape = ModelShape::preset(name).expect("every listed preset has a shape");
        let opts = Options::auto(&shape, &gpu, &CostModel::default());
        group.bench_function(name, |b| {
            b.iter(|| scheduler::build(&shape, &gpu, &opts).expect("presets schedule"))
        });
    }
    group.finish();
}

criterion_group!(benches, build_per_preset);
criterion_main!(benches);
