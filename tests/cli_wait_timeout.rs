//! `--wait-timeout-ms` is range-checked before anything is loaded, on `run` and `bench`.

use std::process::Command;

fn stderr_of(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(args)
        .output()
        .expect("megainfer runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn wait_timeout_out_of_range_is_refused_by_name() {
    for sub in ["run", "bench"] {
        for bad in ["0", "600001", "-5", "soon"] {
            let (ok, err) = stderr_of(&[sub, "--wait-timeout-ms", bad, "-m", "/nonexistent"]);
            assert!(!ok, "{sub} --wait-timeout-ms {bad} was accepted");
            assert!(err.contains("--wait-timeout-ms"), "{sub} {bad}: {err}");
            assert!(
                !err.contains("/nonexistent"),
                "{sub} {bad}: the option should be refused before the model is looked at: {err}"
            );
        }
    }
}
