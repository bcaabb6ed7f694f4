//! `megainfer run --json` on the CPU, with a tiny random HF model directory: one JSON object on
//! stdout whose ids and text are what the CPU reference generates.

#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::path::Path;
use std::process::Command;

use hf_writer::{tiny_config, write_word_model_dir, EOS};
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;
use serde_json::{json, Value};

fn write_model_dir(dir: &Path) {
    // An untied LM head: with tied embeddings this random model repeats one token whatever the
    // context, and a wrong position or cache would go unnoticed.
    write_word_model_dir(dir, &tiny_config(false), 17);
}

fn run_json(dir: &Path, n: usize) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args([
            "run",
            "--device",
            "cpu",
            "--json",
            "-p",
            "hello world",
            "-n",
        ])
        .arg(n.to_string())
        .arg("-m")
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "megainfer run failed: {stderr}");
    // Nothing but the one object on stdout: a script can parse it whole.
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout: {stdout:?}");
    println!("{}", lines[0]);
    serde_json::from_str(lines[0]).unwrap()
}

#[test]
fn run_json_reports_what_the_cpu_reference_generates() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path());
    let n = 6;
    let v = run_json(dir.path(), n);

    let model = megainfer::model::load(dir.path()).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    let prompt = tok.encode("hello world").unwrap();
    assert_eq!(prompt, vec![1, 3, 4], "BOS, hello, world");
    let mut cpu = CpuForward::new(&model.config, &model.weights, 64);
    let mut want = vec![argmax(&cpu.forward(&prompt).unwrap())];
    while want.len() < n && !model.config.eos_token_ids.contains(want.last().unwrap()) {
        want.push(argmax(&cpu.forward(&[*want.last().unwrap()]).unwrap()));
    }
    let stopped_on_eos = model.config.eos_token_ids.contains(want.last().unwrap());
    let mut distinct = want.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= 3,
        "the test model should generate varied tokens, got {want:?}"
    );
    let text_ids: Vec<u32> = want.iter().copied().filter(|&t| t != EOS.1).collect();

    let ids = |key: &str| -> Vec<u32> { serde_json::from_value(v[key].clone()).unwrap() };
    assert_eq!(ids("prompt_ids"), prompt);
    assert_eq!(ids("generated_ids"), want);
    assert_eq!(v["text"], json!(tok.decode(&text_ids).unwrap()));
    assert_eq!(
        v["stop_reason"],
        json!(if stopped_on_eos { "eos" } else { "max_tokens" })
    );
    assert_eq!(v["path"], json!("cpu-reference"));
    assert!(v["device"].as_str().unwrap().starts_with("cpu"), "{v}");
    let ttft = v["ttft_ms"].as_f64().unwrap();
    assert!(ttft > 0.0, "{v}");
    let tok_s = v["decode_tok_s"].as_f64().unwrap();
    assert!(
        if want.len() > 1 {
            tok_s > 0.0
        } else {
            tok_s == 0.0
        },
        "{v}"
    );
}

#[test]
fn run_json_with_zero_tokens_generates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path());
    let v = run_json(dir.path(), 0);
    assert_eq!(v["generated_ids"], json!([]));
    assert_eq!(v["text"], json!(""));
    assert_eq!(v["stop_reason"], json!("max_tokens"));
    assert_eq!(v["decode_tok_s"], json!(0.0));
}

/// Without --json, `-n 0` reports the prompt and that nothing was generated (no time to first
/// token or rates: nothing ran), and `--max-context 0` is refused by name.
#[test]
fn zero_tokens_and_a_zero_context_say_so() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path());
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_megainfer"))
            .args(["run", "--device", "cpu", "-p", "hello world"])
            .args(extra)
            .arg("-m")
            .arg(dir.path())
            .output()
            .unwrap()
    };
    let out = run(&["-n", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("| generated: 0 (--max-tokens 0)")
            && !stderr.contains("time to first token"),
        "{stderr}"
    );
    let out = run(&["--max-context", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--max-context must be at least 1"),
        "{stderr}"
    );
}
