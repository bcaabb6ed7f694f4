//! Ctrl-C (SIGINT) during `megainfer run` ends the generation after the current token: the text
//! so far is printed, the statistics say "interrupted", and the exit status is 130. A tiny
//! random model on the CPU with a long budget, so the signal lands mid-generation.
#![cfg(unix)]

#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hf_writer::{tiny_config, tokenizer_json, write_json, write_model, EOS};
use megainfer::model::random::random_weights;
use safetensors::Dtype;
use serde_json::json;

fn write_model_dir(dir: &Path) {
    let mut cfg = tiny_config(false);
    cfg.max_position_embeddings = 1 << 20;
    // No eos in the vocabulary's reach: the generation runs until stopped.
    cfg.eos_token_ids = vec![];
    write_model(dir, &cfg, &random_weights(&cfg, 23), Dtype::BF16);
    let mut words = vec!["hello".to_string(), "world".to_string()];
    words.extend((5..cfg.vocab_size).map(|i| format!("w{i}")));
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    write_json(&dir.join("tokenizer.json"), &tokenizer_json(&words, true));
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"bos_token": "<s>", "eos_token": EOS.0}),
    );
}

#[test]
fn ctrl_c_ends_the_generation_with_its_statistics_and_status_130() {
    let dir = std::env::temp_dir().join(format!("megainfer-interrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(&dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args([
            "run",
            "--device",
            "cpu",
            "-p",
            "hello world",
            "-n",
            "1000000",
        ])
        .args(["--max-context", "1000010", "-m"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first generated text, then interrupt.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    let n = stdout.read(&mut first).unwrap();
    assert!(n > 0, "no output before the interrupt");
    std::thread::sleep(Duration::from_millis(200));
    let sent = Instant::now();
    // SAFETY: kill with a live child's pid and a signal number.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let took = sent.elapsed();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    println!("exit {status:?} {took:?} after the signal; stderr: {stderr}");
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted (Ctrl-C)"), "{stderr}");
    let generated: usize = stderr
        .split("generated: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(
        generated > 1 && generated < 1_000_000,
        "generated {generated}: {stderr}"
    );
    assert!(
        took < Duration::from_secs(10),
        "stopped {took:?} after Ctrl-C"
    );
}

/// In `chat`, Ctrl-C during a reply ends the reply and the chat goes on: the next message is
/// read and answered, and `/exit` ends it with status 0.
#[test]
fn ctrl_c_in_chat_ends_the_reply_and_the_chat_goes_on() {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("megainfer-interrupt-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(&dir);
    let template = "{% for m in messages %}<s> {{ m.content }} {% endfor %}";
    let cfg_path = dir.join("tokenizer_config.json");
    write_json(
        &cfg_path,
        &json!({"bos_token": "<s>", "eos_token": EOS.0, "chat_template": template}),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(["chat", "--device", "cpu", "-n", "1000000"])
        .args(["--max-context", "1000010", "-m"])
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"hello world\n").unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    assert!(
        stdout.read(&mut first).unwrap() > 0,
        "no reply before the interrupt"
    );
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill with a live child's pid and a signal number.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    std::thread::sleep(Duration::from_millis(300));
    // The chat is back at its prompt: /exit ends it normally.
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    println!("exit {status:?}; stderr: {stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("[reply interrupted (Ctrl-C)"), "{stderr}");
}
