//! `megainfer chat` on the CPU with a tiny random HF model directory and a word-level chat
//! template: turns after the first prefill only their own tokens, and give the reply a fresh
//! greedy run on the whole rendered conversation gives; /reset, a full context and EOF.

#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use hf_writer::{tiny_config, tokenizer_json, write_json, write_model, EOS};
use megainfer::model::random::random_weights;
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;
use megainfer::tokenizer::chat::{render_ids, ChatMessage};
use safetensors::Dtype;
use serde_json::{json, Value};

/// Prefix-stable: each message is `<s> role content </s>`.
const STABLE: &str = "{% for m in messages %}<s> {{ m.role }} {{ m.content }} </s> {% endfor %}\
                      {% if add_generation_prompt %}<s> assistant {% endif %}";

/// Not prefix-stable: once there is a second user message, a word appears after the first
/// message, so the second turn must rewind into the cached tokens.
const UNSTABLE: &str = "{% for m in messages %}<s> {{ m.role }} {{ m.content }} </s> \
                        {% if loop.first and messages|length > 2 %}world {% endif %}{% endfor %}\
                        {% if add_generation_prompt %}<s> assistant {% endif %}";

fn write_model_dir(dir: &Path, template: &str) {
    // An untied LM head: with tied embeddings this model repeats its input token whatever the
    // context, which would let a wrong cache go unnoticed.
    let cfg = tiny_config(false);
    write_model(dir, &cfg, &random_weights(&cfg, 17), Dtype::BF16);
    let mut words: Vec<String> = ["hello", "world", "user", "assistant", "system"]
        .map(String::from)
        .to_vec();
    words.extend((3 + words.len()..cfg.vocab_size).map(|i| format!("w{i}")));
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut tok = tokenizer_json(&words, false);
    // Only eos is special, so a reply holding `<unk>` or `<s>` decodes to text that encodes
    // back to the same ids: the conversation re-renders to exactly the tokens generated.
    for added in tok["added_tokens"].as_array_mut().unwrap() {
        if added["content"] != json!(EOS.0) {
            added["special"] = json!(false);
        }
    }
    write_json(&dir.join("tokenizer.json"), &tok);
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"bos_token": "<s>", "eos_token": EOS.0, "chat_template": template}),
    );
}

struct Output {
    events: Vec<Value>,
    stdout: String,
    stderr: String,
}

fn chat(dir: &Path, extra: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(["chat", "--device", "cpu", "--verbose"])
        .args(extra)
        .arg("-m")
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    println!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(out.status.success(), "megainfer chat failed: {stderr}");
    let events = if extra.contains(&"--json") {
        stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    } else {
        Vec::new()
    };
    Output {
        events,
        stdout,
        stderr,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// What a fresh greedy run generates after the whole of `prompt`, batched prefill first.
fn fresh_greedy(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let model = megainfer::model::load(dir).unwrap();
    let mut cpu = CpuForward::new(&model.config, &model.weights, 256);
    let mut out = vec![argmax(&cpu.prefill(prompt, 64).unwrap())];
    while out.len() < n && *out.last().unwrap() != EOS.1 {
        out.push(argmax(&cpu.forward(&[*out.last().unwrap()]).unwrap()));
    }
    out
}

/// The token ids the model's template gives `messages`, plus the generation prompt.
fn rendering(dir: &Path, messages: &[ChatMessage]) -> Vec<u32> {
    let model = megainfer::model::load(dir).unwrap();
    render_ids(model.tokenizer.as_ref().unwrap(), messages, true).unwrap()
}

/// The second turn feeds only what follows the cache (the first reply's last token, which was
/// generated but never fed, and the new message) and replies as a fresh run on the whole
/// rendering would.
#[test]
fn second_turn_prefills_only_new_tokens_and_matches_a_fresh_run() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    let n = 6;
    let out = chat(
        dir.path(),
        &["--json", "-n", &n.to_string()],
        "hello world\nworld hello hello\n",
    );
    let [first, second] = &out.events[..] else {
        panic!("want two turns, got {:?}", out.events)
    };
    let gen1 = ids(&first["generated_ids"]);
    let gen2 = ids(&second["generated_ids"]);
    assert!(!gen1.is_empty() && !gen2.is_empty());

    let turn1 = vec![ChatMessage::new("user", "hello world")];
    let prompt1 = rendering(dir.path(), &turn1);
    assert_eq!(
        prompt1,
        vec![1, 5, 3, 4, 2, 1, 6],
        "<s> user hello world </s> <s> assistant"
    );
    assert_eq!(first["prompt_tokens"], json!(prompt1.len()));
    assert_eq!(first["reused"], json!(0));
    assert_eq!(first["prefilled"], json!(prompt1.len()));
    assert_eq!(gen1, fresh_greedy(dir.path(), &prompt1, n));

    let turn2 = vec![
        turn1[0].clone(),
        ChatMessage::new("assistant", first["reply"].as_str().unwrap()),
        ChatMessage::new("user", "world hello hello"),
    ];
    let prompt2 = rendering(dir.path(), &turn2);
    let cached = prompt1.len() + gen1.len() - 1;
    assert_eq!(
        prompt2[..cached],
        [&prompt1[..], &gen1[..gen1.len() - 1]].concat()[..]
    );
    assert_eq!(second["prompt_tokens"], json!(prompt2.len()));
    assert_eq!(second["rewound"], json!(false));
    assert_eq!(second["reused"], json!(cached));
    assert_eq!(second["prefilled"], json!(prompt2.len() - cached));
    assert_eq!(gen2, fresh_greedy(dir.path(), &prompt2, n));
    // The reply depends on the first turn, so a cache that lost it would have been caught.
    let alone = rendering(dir.path(), &turn2[2..]);
    assert_ne!(gen2, fresh_greedy(dir.path(), &alone, n));
    assert_eq!(
        second["context_used"],
        json!(prompt2.len() + gen2.len()),
        "{second}"
    );
    assert!(
        out.stderr.contains(&format!(
            "[prefill: {} new tokens, {cached} reused from the cache",
            prompt2.len() - cached
        )),
        "{}",
        out.stderr
    );
}

/// A template that renders the earlier conversation differently: the cache is rewound to the
/// first differing token, and the reply is still that of a fresh run.
#[test]
fn a_template_that_is_not_prefix_stable_rewinds_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), UNSTABLE);
    let n = 5;
    let out = chat(
        dir.path(),
        &["--json", "-n", &n.to_string()],
        "hello world\nworld hello\n",
    );
    let [first, second] = &out.events[..] else {
        panic!("want two turns, got {:?}", out.events)
    };
    let turn2 = vec![
        ChatMessage::new("user", "hello world"),
        ChatMessage::new("assistant", first["reply"].as_str().unwrap()),
        ChatMessage::new("user", "world hello"),
    ];
    let prompt2 = rendering(dir.path(), &turn2);
    // `<s> user hello world </s>` is shared; the inserted `world` differs.
    assert_eq!(second["rewound"], json!(true));
    assert_eq!(second["reused"], json!(5));
    assert_eq!(second["prefilled"], json!(prompt2.len() - 5));
    assert_eq!(
        ids(&second["generated_ids"]),
        fresh_greedy(dir.path(), &prompt2, n)
    );
    assert!(
        out.stderr
            .contains("renders the earlier conversation differently from token 5"),
        "{}",
        out.stderr
    );
}

#[test]
fn reset_gives_the_first_reply_of_a_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    let out = chat(
        dir.path(),
        &["--json", "-n", "5"],
        "hello world\nworld world\n/reset\nhello world\n",
    );
    let [first, _second, reset, again] = &out.events[..] else {
        panic!("want turn, turn, reset, turn; got {:?}", out.events)
    };
    assert_eq!(reset, &json!({"event": "reset"}));
    assert_eq!(again["reused"], json!(0));
    assert_eq!(again["prompt_tokens"], first["prompt_tokens"]);
    assert_eq!(again["generated_ids"], first["generated_ids"]);
    assert_eq!(again["reply"], first["reply"]);
    assert!(out.stderr.contains("[conversation cleared; context: 0/"));
}

/// A message that does not fit is refused with the numbers and a hint, the process goes on,
/// and after /reset the chat works again.
#[test]
fn a_full_context_is_reported_and_reset_recovers() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    let long = vec!["hello"; 30].join(" ");
    let out = chat(
        dir.path(),
        &["--json", "-n", "4", "--max-context", "24"],
        &format!("hello world\n{long}\n/reset\nhello world\n"),
    );
    let [first, full, reset, again] = &out.events[..] else {
        panic!("want turn, context_full, reset, turn; got {:?}", out.events)
    };
    let want_tokens = rendering(
        dir.path(),
        &[
            ChatMessage::new("user", "hello world"),
            ChatMessage::new("assistant", first["reply"].as_str().unwrap()),
            ChatMessage::new("user", long.as_str()),
        ],
    )
    .len();
    assert!(want_tokens > 24);
    assert_eq!(
        full,
        &json!({"event": "context_full", "tokens": want_tokens, "max_context": 24})
    );
    assert!(
        out.stderr.contains(&format!(
            "[context full: the conversation with this message is {want_tokens} tokens, the \
             limit is 24 (--max-context); the message was not sent. Type /reset"
        )),
        "{}",
        out.stderr
    );
    assert_eq!(reset, &json!({"event": "reset"}));
    assert_eq!(again["generated_ids"], first["generated_ids"]);
}

/// A reply is cut where the context ends, and says so.
#[test]
fn a_reply_stops_at_the_end_of_the_context() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    // The prompt is 7 tokens: 3 are left for the reply.
    let out = chat(
        dir.path(),
        &["--json", "-n", "50", "--max-context", "10"],
        "hello world\n",
    );
    let [turn] = &out.events[..] else {
        panic!("want one turn, got {:?}", out.events)
    };
    let gen = ids(&turn["generated_ids"]);
    let want = fresh_greedy(dir.path(), &[1, 5, 3, 4, 2, 1, 6], 3);
    assert_eq!(gen, want);
    if want.len() == 3 && want[2] != EOS.1 {
        assert_eq!(turn["stop_reason"], json!("context_full"));
        assert!(out
            .stderr
            .contains("[the reply was cut off: the context of 10 tokens is full"));
    } else {
        assert_eq!(turn["stop_reason"], json!("eos"));
    }
    assert!(out
        .stderr
        .contains(&format!("[context: {}/10 tokens]", 7 + gen.len())));
}

/// Streaming mode: the reply's text on stdout, status on stderr; EOF without a newline or
/// /exit ends cleanly, and nothing after /exit is read.
#[test]
fn streams_replies_and_ends_at_eof_or_exit() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    let json = chat(dir.path(), &["--json", "-n", "5"], "hello world\n");
    let reply = json.events[0]["reply"].as_str().unwrap().to_string();

    let out = chat(dir.path(), &["-n", "5"], "hello world");
    assert_eq!(out.stdout, format!("{reply}\n"));
    let used = json.events[0]["context_used"].as_u64().unwrap();
    assert!(out
        .stderr
        .contains(&format!("[context: {used}/256 tokens]")));

    let out = chat(
        dir.path(),
        &["-n", "5"],
        "hello world\n/exit\nhello world\n",
    );
    assert_eq!(out.stdout, format!("{reply}\n"), "one reply: /exit stops");

    let out = chat(dir.path(), &["-n", "5"], "");
    assert_eq!(out.stdout, "");
}

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;

/// Every GPU path: a chat-like sequence (prefill, greedy decode, a rewind into the cached
/// tokens, a second prefill, more decoding) gives the logits the CPU reference gives for a
/// fresh run on the surviving tokens. Tolerance as tests/gpu_prefill.rs (bf16 prefill products).
#[test]
#[ignore = "needs a GPU"]
fn gpu_paths_rewind_like_a_fresh_run() {
    use megainfer::generate::Backend;
    use megainfer::gpu::model::DeviceModel;
    use megainfer::gpu::paths::{GpuPath, PathKind};

    const TOL: f64 = 1e-2;
    let gpu = gpu_common::gpu();
    let (_, cfg, w, tokens) = gpu_common::small_cases().swap_remove(1);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let second: Vec<u32> = (0..7).map(|k| (k * 31 + 5) % 1000).collect();
    for kind in PathKind::ALL {
        let mut path = GpuPath::new(kind, &gpu, &dm, 64, 64).unwrap();
        let mut worst = 0f64;
        // Turn 1, and 3 decoded tokens the rewind will drop.
        path.feed(&tokens).unwrap();
        let mut t = *tokens.last().unwrap();
        for _ in 0..3 {
            t = path.feed_greedy(t).unwrap();
        }
        for keep in [5, 0] {
            path.rewind(keep).unwrap();
            let seq: Vec<u32> = [&tokens[..keep], &second[..]].concat();
            let mut cpu = CpuForward::new(&cfg, &w, 64);
            let want = cpu.prefill(&seq, 64).unwrap();
            let got = path.feed(&second).unwrap();
            let err = megainfer::reference::rel_l2(&got, &want);
            worst = worst.max(err);
            println!("{} rewind to {keep}: prefill rel L2 {err:.2e}", kind.name());
            assert!(
                err <= TOL,
                "{}: rewind to {keep}: rel L2 {err:.2e}",
                kind.name()
            );
            // Decoding continues from the rewound position.
            let mut t = argmax(&want);
            for step in 0..4 {
                let want = cpu.forward(&[t]).unwrap();
                let got = path.feed(&[t]).unwrap();
                let err = megainfer::reference::rel_l2(&got, &want);
                worst = worst.max(err);
                assert!(
                    err <= TOL,
                    "{}: rewind to {keep}, step {step}: rel L2 {err:.2e}",
                    kind.name()
                );
                t = argmax(&want);
            }
        }
        assert!(
            path.rewind(40).is_err(),
            "rewinding past the cache must fail"
        );
        println!(
            "{}: worst rel L2 {worst:.2e} (tolerance {TOL:.0e})",
            kind.name()
        );
    }
}

/// Bad setups are refused with an error that names what is wrong.
#[test]
fn a_model_without_a_template_or_a_zero_budget_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), STABLE);
    let run = |dir: &Path, extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
            .args(["chat", "--device", "cpu"])
            .args(extra)
            .arg("-m")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        String::from_utf8(out.stderr).unwrap()
    };
    let err = run(dir.path(), &["-n", "0"]);
    assert!(err.contains("--max-tokens must be at least 1"), "{err}");
    write_json(
        &dir.path().join("tokenizer_config.json"),
        &json!({"bos_token": "<s>", "eos_token": EOS.0}),
    );
    let err = run(dir.path(), &[]);
    assert!(err.contains("this model has no chat template"), "{err}");
    assert!(err.contains("tokenizer.json"), "{err}");
}
