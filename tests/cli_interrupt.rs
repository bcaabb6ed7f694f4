//! Ctrl-C (SIGINT) during `megainfer run` ends the generation after the current token: the text
//! so far is printed, the statistics say "interrupted", and the exit status is 130. A tiny
//! random model on the CPU with a long budget, so the signal lands mid-generation.
#![cfg(unix)]

#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::io::Read;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hf_writer::{tiny_config, write_json, write_word_model_dir, EOS};
use serde_json::json;

fn write_model_dir(dir: &Path) {
    let mut cfg = tiny_config(false);
    cfg.max_position_embeddings = 1 << 20;
    // No eos in the vocabulary's reach: the generation runs until stopped.
    cfg.eos_token_ids = vec![];
    write_word_model_dir(dir, &cfg, 23);
}

/// Waits for the child's first output on `stdout`, lets it run a little longer, and sends it
/// SIGINT; returns when the signal went.
fn interrupt_after_first_output(child: &Child, stdout: &mut ChildStdout) -> Instant {
    let mut first = [0u8; 16];
    assert!(
        stdout.read(&mut first).unwrap() > 0,
        "no output before the interrupt"
    );
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill with a live child's pid and a signal number.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    Instant::now()
}

/// Drains the child's stdout, waits for it, and returns its exit status and stderr.
fn finish(mut child: Child, mut stdout: ChildStdout) -> (ExitStatus, String) {
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
    (status, stderr)
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
    let mut stdout = child.stdout.take().unwrap();
    let sent = interrupt_after_first_output(&child, &mut stdout);
    let (status, stderr) = finish(child, stdout);
    let took = sent.elapsed();
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

/// In `chat`, Ctrl-C during a reply ends the reply and the chat goes on: it is back at its
/// prompt, where `/exit` ends it with status 0.
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
    interrupt_after_first_output(&child, &mut stdout);
    std::thread::sleep(Duration::from_millis(300));
    // The chat is back at its prompt: /exit ends it normally.
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let (status, stderr) = finish(child, stdout);
    std::fs::remove_dir_all(&dir).ok();
    println!("exit {status:?}; stderr: {stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("[reply interrupted (Ctrl-C)"), "{stderr}");
}
