//! `megainfer schedule` prints and exports exactly the schedule `run` and `bench` execute, and
//! refuses impossible options with the option's name and range.

use std::process::Command;

use megainfer::gpu::megakernel::{
    megakernel_gpu_shape, megakernel_schedule, schedule_for, H100_SMEM_PER_BLOCK, H100_SMS,
};
use megainfer::model::presets;
use scheduler::dump::{summarize, to_json, JsonSchedule};
use scheduler::{CostModel, GpuShape, Overrides, Schedule};

fn schedule_cmd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .arg("schedule")
        .args(args)
        .output()
        .expect("run megainfer")
}

/// Runs `schedule` with `args` and `--json`; returns stdout and the parsed JSON.
fn printed(args: &[&str]) -> (String, JsonSchedule) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.json");
    let mut all = args.to_vec();
    all.extend(["--json", json.to_str().unwrap()]);
    let out = schedule_cmd(&all);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).unwrap();
    (stdout, serde_json::from_str(&text).unwrap())
}

fn check_same(args: &[&str], want: &Schedule, cost: &CostModel) {
    let (stdout, json) = printed(args);
    assert_eq!(json, to_json(want), "{args:?}: JSON differs");
    let summary = summarize(want, cost).to_string();
    assert!(
        stdout.contains(&summary),
        "{args:?}: printed\n{stdout}\nwanted\n{summary}"
    );
    assert!(!stdout.contains("counter"), "{stdout}");
}

/// SmolLM2's shape on a GPU of 7 SMs and 12 pages, costed at 100 positions, and the options
/// that ask `schedule` for it.
fn seven_sms() -> (megainfer::model::Config, GpuShape, CostModel) {
    let gpu = GpuShape {
        sm_count: 7,
        smem_pages: 12,
        page_bytes: 16384,
    };
    (
        presets::by_name("smollm2-135m").unwrap(),
        gpu,
        CostModel::megakernel(100),
    )
}
const SEVEN_SMS: [&str; 8] = [
    "--preset",
    "smollm2-135m",
    "--sms",
    "7",
    "--pages",
    "12",
    "--context",
    "100",
];

#[test]
fn explicit_gpu_shape_prints_the_megakernels_schedule() {
    let (cfg, gpu, cost) = seven_sms();
    let want = megakernel_schedule(&cfg, &gpu, &cost, &Overrides::default()).unwrap();
    let args = SEVEN_SMS;
    check_same(&args, &want, &cost);
    // A granularity override goes through the same function.
    let parts = Overrides {
        attn_parts: Some(3),
        ..Default::default()
    };
    let want = megakernel_schedule(&cfg, &gpu, &cost, &parts).unwrap();
    let mut with_parts = args.to_vec();
    with_parts.extend(["--attn-parts", "3"]);
    check_same(&with_parts, &want, &cost);
}

/// With no GPU options: the GPU's own figures, i.e. what `schedule_for` gives `run` and
/// `bench`; without a GPU, an H100's, said in the output.
#[test]
fn defaults_are_the_gpus_or_an_h100s() {
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let cost = CostModel::megakernel(1024);
    let args = ["--preset", "llama-3.2-1b"];
    if megainfer::gpu::available() {
        let gpu = megainfer::gpu::device::Gpu::new(0).unwrap();
        let want = schedule_for(&cfg, &gpu, 1024, None).unwrap();
        check_same(&args, &want, &cost);
        let (stdout, _) = printed(&args);
        assert!(stdout.contains(&gpu.name), "{stdout}");
    } else {
        let shape = megakernel_gpu_shape(&cfg, H100_SMS, H100_SMEM_PER_BLOCK);
        let want = megakernel_schedule(&cfg, &shape, &cost, &Overrides::default()).unwrap();
        check_same(&args, &want, &cost);
        let (stdout, _) = printed(&args);
        assert!(stdout.contains("assuming an H100"), "{stdout}");
        // The page count the megakernel leaves on an H100 for this model.
        assert_eq!(shape.smem_pages, 12);
    }
}

/// The context buckets `run` and `bench` switch between are listed, as
/// `scheduler::plan_buckets` makes them for an H100.
#[test]
fn context_buckets_are_listed() {
    let cfg = presets::by_name("smollm2-135m").unwrap();
    let shape = megakernel_gpu_shape(&cfg, H100_SMS, H100_SMEM_PER_BLOCK);
    let model = megainfer::reference::sliced::shape_of(&cfg);
    let buckets = scheduler::plan_buckets(
        &model,
        &shape,
        &CostModel::megakernel(8192),
        &Overrides::default(),
        8192,
    )
    .unwrap();
    let (stdout, _) = printed(&[
        "--preset",
        "smollm2-135m",
        "--sms",
        "132",
        "--pages",
        "12",
        "--context",
        "8192",
    ]);
    assert!(
        stdout.contains("context buckets for sequences up to 8192 positions:"),
        "{stdout}"
    );
    assert!(buckets.len() >= 2);
    for b in &buckets {
        let line = format!(
            "up to {:>7}: {:>3} split-KV parts",
            b.upto, b.schedule.options.attn_parts
        );
        assert!(stdout.contains(&line), "{line} not in\n{stdout}");
    }
}

/// As the megakernel runs them: Llama-1B's one bucket of 16 parts from 4K to 128K is listed cut
/// at 64K, the part up to it streaming its K/V with 2 tiles in flight, the rest and the shorter
/// buckets not.
#[test]
fn the_split_kv_bucket_is_listed_cut_at_64k() {
    let (stdout, _) = printed(&[
        "--preset",
        "llama-3.2-1b",
        "--sms",
        "132",
        "--context",
        "131072",
    ]);
    let line = |upto: usize| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("up to {upto:>7}:")))
            .unwrap_or_else(|| panic!("no bucket up to {upto} in\n{stdout}"))
            .to_string()
    };
    assert!(
        line(65536).ends_with("K/V streamed 2 tiles in flight"),
        "{stdout}"
    );
    assert!(!line(131072).contains("in flight"), "{stdout}");
    assert!(!line(4096).contains("in flight"), "below 4K: {stdout}");
    assert!(!line(512).contains("in flight"), "one part: {stdout}");
    // Both pieces of the 4K-128K bucket name it (its schedule is costed for the whole bucket);
    // a bucket that is not cut does not.
    for upto in [65536, 131072] {
        assert!(
            line(upto).contains("(a piece of the bucket of 4097 to 131072 positions, costed at"),
            "{stdout}"
        );
    }
    assert!(!line(4096).contains("piece"), "{stdout}");
}

#[test]
fn impossible_options_are_refused_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (&["--sms", "65536"], "--sms 65536"),
        (&["--sms", "0"], "--sms 0"),
        (&["--pages", "0"], "--pages 0"),
        (&["--pages", "100000"], "--pages 100000"),
        (&["--context", "0"], "--context 0"),
        (&["--context", "99999999999"], "--context 99999999999"),
        (&["--latency-us", "0"], "--latency-us 0"),
        (&["--latency-us=-1"], "--latency-us -1"),
        (&["--latency-us", "nan"], "--latency-us NaN"),
        (&["--latency-us", "1e9"], "--latency-us 1"),
        (&["--bandwidth", "inf"], "--bandwidth inf"),
        (&["--bandwidth", "0"], "--bandwidth 0"),
    ];
    for (extra, named) in cases {
        let mut args = vec!["--preset", "smollm2-135m"];
        args.extend_from_slice(extra);
        let start = std::time::Instant::now();
        let out = schedule_cmd(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(
            err.contains(named) && err.contains("outside the allowed range"),
            "{args:?}: {err}"
        );
        assert!(
            start.elapsed().as_secs() < 30,
            "{args:?}: {:?}",
            start.elapsed()
        );
    }
}

/// An unknown preset is refused naming every known one, for `schedule` and `bench` alike (no
/// GPU needed: the arguments are checked first); a Qwen3 shape's QKV instructions are cut
/// within heads like any other model's (its q/k norms are applied by attention).
#[test]
fn presets_are_listed_and_qwen3_heads_are_cut_like_any_model() {
    for cmd in ["schedule", "bench"] {
        let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
            .args([cmd, "--preset", "nope"])
            .output()
            .expect("run megainfer");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{cmd}: {err}");
        for name in presets::NAMES {
            assert!(err.contains(name), "{cmd}: {name} missing from {err}");
        }
    }
    let (_, json) = printed(&["--preset", "qwen3-0.6b", "--sms", "132"]);
    assert!(
        json.options.qkv_pairs < 64,
        "head_dim 128: {} pairs, a whole head",
        json.options.qkv_pairs
    );
    let (_, json) = printed(&["--preset", "qwen3-0.6b", "--qkv-pairs", "8"]);
    assert_eq!(json.options.qkv_pairs, 8);
}

/// The MEGAINFER_MK_* granularity variables that `run` and `bench` read reach `schedule` too
/// (the options given on the command line win), and a bad value names its variable.
#[test]
fn environment_overrides_are_the_paths_own() {
    let (cfg, gpu, cost) = seven_sms();
    let args = SEVEN_SMS;
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("s.json");
        let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
            .arg("schedule")
            .args(args)
            .args(extra)
            .args(["--json", json.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .expect("run megainfer");
        let text = std::fs::read_to_string(&json).ok();
        (out, text)
    };
    let env = [
        ("MEGAINFER_MK_DOWN_CHUNKS", "2"),
        ("MEGAINFER_MK_UPGATE_ROWS", "8"),
    ];
    let (out, json) = run(&[], &env);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("from the environment (under the options given): MEGAINFER_MK_UPGATE_ROWS, MEGAINFER_MK_DOWN_CHUNKS"),
        "{stdout}"
    );
    let want = megakernel_schedule(
        &cfg,
        &gpu,
        &cost,
        &Overrides {
            down_chunks: Some(2),
            upgate_rows: Some(8),
            ..Default::default()
        },
    )
    .unwrap();
    let got: JsonSchedule = serde_json::from_str(&json.unwrap()).unwrap();
    assert_eq!(got, to_json(&want), "the environment's overrides");

    // An option on the command line wins over its variable.
    let (out, json) = run(&["--down-chunks", "1"], &env);
    assert!(out.status.success());
    let want = megakernel_schedule(
        &cfg,
        &gpu,
        &cost,
        &Overrides {
            down_chunks: Some(1),
            upgate_rows: Some(8),
            ..Default::default()
        },
    )
    .unwrap();
    let got: JsonSchedule = serde_json::from_str(&json.unwrap()).unwrap();
    assert_eq!(
        got,
        to_json(&want),
        "--down-chunks over MEGAINFER_MK_DOWN_CHUNKS"
    );

    let (out, _) = run(&[], &[("MEGAINFER_MK_DOWN_CHUNKS", "x")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("MEGAINFER_MK_DOWN_CHUNKS"), "{stderr}");
}

/// A schedule the megakernel cannot run is shown with a warning that `run` and `bench` would
/// refuse it: one k-chunk of Qwen3-4B's 9,728-column down projection is over a 16 KiB page.
#[test]
fn schedules_past_the_megakernels_limits_are_flagged() {
    let out = schedule_cmd(&["--preset", "qwen3-4b", "--sms", "132", "--down-chunks", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the megakernel cannot run this schedule")
            && stderr.contains("9728 columns does not fit a 16384-byte page"),
        "{stderr}"
    );
    // Three k-chunks (the cost model's) fit: no warning.
    let out = schedule_cmd(&["--preset", "qwen3-4b", "--sms", "132", "--down-chunks", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("cannot run"), "{stderr}");
}
