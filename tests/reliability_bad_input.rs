//! Hostile model files and misuse: claims in headers that would cost huge work or memory,
//! special tokens that make loading quadratic, chat templates that never end, tokenizer.json
//! files that make the tokenizers crate panic, broken downloads and cache files, and CLI
//! values. Each must end in a prompt error that names the file, limit or argument.

#[path = "common/alloc_track.rs"]
mod alloc_track;
#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use alloc_track::{allocation_bound, largest_allocation};
use gguf_writer::{add_tiny_tokenizer, tiny_llama, Val};
use hf_writer::*;
use megainfer::fetch::{clean_stale_downloads, ensure_cached, verify_cached, Artifact};
use megainfer::model::random::random_weights;
use megainfer::tokenizer::chat::{render, ChatMessage};
use megainfer::tokenizer::Tokenizer;
use safetensors::Dtype;
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: alloc_track::Tracking = alloc_track::Tracking;

fn assert_contains(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in: {msg}");
    }
}

/// Loads `path`, which must fail within `limit` and without an allocation above the bound for
/// a file of `file_bytes`; returns the error.
fn load_fails_fast(path: &Path, file_bytes: usize, limit: Duration) -> String {
    let start = Instant::now();
    let (result, largest) = largest_allocation(|| megainfer::model::load(path));
    let took = start.elapsed();
    let err = match result {
        Ok(_) => panic!("{} loaded, but it is hostile", path.display()),
        Err(e) => format!("{e:#}"),
    };
    println!(
        "{}: {file_bytes} bytes, failed in {took:?}, largest allocation {largest} bytes: {err}",
        path.display()
    );
    assert!(took < limit, "took {took:?} (limit {limit:?}): {err}");
    assert!(
        largest <= allocation_bound(file_bytes),
        "largest allocation {largest} bytes for a {file_bytes}-byte file"
    );
    err
}

/// A tiny valid HF model directory (no tokenizer).
fn tiny_hf_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(true);
    write_model(dir.path(), &cfg, &random_weights(&cfg, 5), Dtype::BF16);
    dir
}

fn dir_bytes(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len() as usize)
        .sum()
}

// ---- 1, 2: work bounded by the file, not by its claims ----

#[test]
fn hf_config_claiming_millions_of_layers() {
    let dir = tiny_hf_dir();
    let mut config = config_json(&tiny_config(true));
    config["num_hidden_layers"] = json!(16_777_216);
    write_json(&dir.path().join("config.json"), &config);
    let err = load_fails_fast(dir.path(), dir_bytes(dir.path()), Duration::from_secs(2));
    assert_contains(
        &err,
        &[
            "config.json",
            "num_hidden_layers is 16777216",
            "model.safetensors holds only 20 tensors",
        ],
    );
}

#[test]
fn hf_problem_list_is_capped() {
    // Two layers claimed too many for the tensors present, but few enough to pass the count
    // check: every tensor of the real layers is then "unexpected" or mis-shaped, and the message
    // stays short however many there are.
    let dir = tiny_hf_dir();
    let mut config = config_json(&tiny_config(true));
    config["hidden_size"] = json!(32);
    config["head_dim"] = json!(8);
    write_json(&dir.path().join("config.json"), &config);
    let err = load_fails_fast(dir.path(), dir_bytes(dir.path()), Duration::from_secs(2));
    assert_contains(&err, &["weights do not match the config", "... and"]);
    assert!(err.lines().count() <= 14, "too long: {err}");
}

#[test]
fn gguf_with_many_tiny_tensors_and_a_matching_block_count() {
    const N: usize = 200_000;
    let mut g = tiny_llama();
    g.tensors.clear();
    for i in 0..N {
        g.add_tensor(&format!("blk.{i}.x.weight"), &[1], 0, vec![0; 4]);
    }
    g.set("llama.block_count", Val::U32(N as u32));
    let bytes = g.to_bytes();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_fails_fast(&path, bytes.len(), Duration::from_secs(5));
    assert_contains(
        &err,
        &[
            "many.gguf",
            "llama.block_count is 200000",
            "needs at least 1800002 tensors",
            "only 200000 tensors",
        ],
    );
}

// ---- 5: special tokens whose length would make loading quadratic ----

#[test]
fn gguf_control_token_too_long() {
    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    let mut tokens: Vec<String> = ('a'..='z').map(String::from).collect();
    let long = format!("<|{}|>", "x".repeat(1_000_000));
    tokens.extend(["ab", "Ġ", "<s>", "</s>", &long, "<|im_end|>"].map(String::from));
    g.set("tokenizer.ggml.tokens", Val::Strs(tokens));
    let bytes = g.to_bytes();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long_token.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_fails_fast(&path, bytes.len(), Duration::from_secs(2));
    assert_contains(
        &err,
        &[
            "long_token.gguf",
            "control token 30",
            "1000004 bytes",
            "MAX_SPECIAL_TOKEN_BYTES",
        ],
    );
}

#[test]
fn hf_added_token_too_long() {
    let dir = tiny_hf_dir();
    let mut tok = tokenizer_json(&["a", "b"], false);
    tok["added_tokens"][1]["content"] = json!("<".repeat(1_000_000));
    write_json(&dir.path().join("tokenizer.json"), &tok);
    let err = load_fails_fast(dir.path(), dir_bytes(dir.path()), Duration::from_secs(2));
    assert_contains(
        &err,
        &[
            "tokenizer.json",
            "added_tokens[1]",
            "MAX_SPECIAL_TOKEN_BYTES",
        ],
    );
}

#[test]
fn special_tokens_at_the_limit_still_load_quickly() {
    let dir = tiny_hf_dir();
    let mut tok = tokenizer_json(&["a", "b"], false);
    let limit = megainfer::tokenizer::MAX_SPECIAL_TOKEN_BYTES;
    tok["added_tokens"][1]["content"] = json!("z".repeat(limit));
    tok["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .insert("z".repeat(limit), json!(1));
    write_json(&dir.path().join("tokenizer.json"), &tok);
    let start = Instant::now();
    let model = megainfer::model::load(dir.path()).unwrap();
    println!(
        "a {limit}-byte special token: loaded in {:?}",
        start.elapsed()
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(model.tokenizer.is_some());
}

// ---- 6: chat templates from the model file ----

fn user(text: &str) -> ChatMessage {
    ChatMessage::new("user", text)
}

#[test]
fn chat_template_that_loops_for_ever() {
    let template =
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let start = Instant::now();
    let err = format!(
        "{:#}",
        render(template, &[user("x")], "", "", true).unwrap_err()
    );
    println!("looping template stopped in {:?}: {err}", start.elapsed());
    assert_contains(&err, &["MAX_TEMPLATE_FUEL"]);
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn chat_template_with_huge_output() {
    let template = "{% for i in range(100000) %}{{ 'x' * 10000000 }}{% endfor %}";
    let start = Instant::now();
    let (result, largest) = largest_allocation(|| render(template, &[user("x")], "", "", true));
    let err = format!("{:#}", result.unwrap_err());
    println!(
        "huge-output template stopped in {:?}, largest allocation {largest}: {err}",
        start.elapsed()
    );
    assert_contains(&err, &["MAX_TEMPLATE_OUTPUT_BYTES"]);
    assert!(largest < 64 << 20);
}

/// Renders `template`, which must fail quickly with an error naming `limit` and without one
/// allocation above the 64 MB bound.
fn template_stops_at(template: &str, limit: &str) {
    template_stops_within(template, limit, Duration::from_secs(10));
}

/// [`template_stops_at`], within `time`.
fn template_stops_within(template: &str, limit: &str, time: Duration) {
    let start = Instant::now();
    let (result, largest) = largest_allocation(|| render(template, &[user("x")], "", "", true));
    let Err(err) = result else {
        panic!("{template}: rendered");
    };
    let err = format!("{err:#}");
    println!(
        "{template}\n  stopped in {:?}, largest allocation {largest}: {err}",
        start.elapsed()
    );
    assert_contains(&err, &[limit]);
    assert!(
        largest <= allocation_bound(template.len()),
        "{template}: largest allocation {largest} bytes"
    );
    assert!(start.elapsed() < time, "{template}: {:?}", start.elapsed());
}

#[test]
fn chat_template_strings_are_capped() {
    for template in [
        // Found by fuzzing: `'{' * 99999993.0`, under minijinja's own 100 MB bound for `*` and
        // made while compiling, as minijinja evaluates operators on constants then.
        "{s{{-3-3333333-3-33333331*3.*'{'*3.*i33}}",
        "{{ 'x' * 50000000 }}",
        // The same when rendering: the count is a variable, not a constant.
        "{% set n = 50000000 %}{{ 'x' * n }}",
        // Doubling a string: 40 rounds need a few hundred instructions of fuel.
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}\
         {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}\
         {% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
        // Builtins that return far more than they are given.
        "{{ (['x' * 10000000] * 100)|join }}",
        "{% set s = 'x' * 10000 %}{{ s|replace('', s) }}",
        "{{ 'a\nb'|indent(1000000000) }}",
        "{{ '%100000000d'|format(1) }}",
        "{{ '{:>100000000}'.format(1) }}",
        "{{ [1]|tojson(indent=1000000000) }}",
        "{{ [1]|tojson(separators=[['x' * 100] * 1000000, ':']) }}",
        // A lazily repeated list, written out as text.
        "{{ (['x' * 100] * 1000000)|string }}",
        "{% set a = ['x' * 100] * 1000000 %}{{ a ~ 'x' }}",
    ] {
        template_stops_at(template, "MAX_TEMPLATE_STRING_BYTES");
    }
}

#[test]
fn chat_template_lists_are_capped() {
    for template in [
        // A list doubled with `+`: minijinja joins lazily, then copies a chain deeper than 32
        // into one list, here of 2^33 items (206 GB), which aborted the process.
        "{% set ns = namespace(s=[0]) %}{% for i in range(40) %}\
         {% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
        // The same through `chain`.
        "{% set ns = namespace(s=[0]) %}{% for i in range(40) %}\
         {% set ns.s = ns.s|chain(ns.s) %}{% endfor %}{{ ns.s|length }}",
        // Lists from a string within its own limit: one item per character or piece.
        "{{ ('x' * 16000000)|list|length }}",
        "{{ ('x ' * 8000000)|split|length }}",
        "{{ ('x,' * 8000000).split(',')|length }}",
        "{{ ('\n' * 8000000)|lines|length }}",
        "{{ ('\n' * 8000000).splitlines()|length }}",
        // Lazily repeated lists: free until a builtin copies or walks them.
        "{{ ([0] * 10000000)|list|length }}",
        "{% set n = 10000000 %}{{ ([0] * n)|list|length }}",
        "{{ [0] * 100000000 }}",
        "{{ 1 in [0] * 100000000 }}",
        "{% set n = 100000000 %}{{ 1 in [0] * n }}",
        "{{ ([0] * 100000000)|join }}",
        "{% set a = [0] * 600000 %}{{ (a + a)|length }}",
        "{% set a = range(100000)|list %}{{ (a * 20)|sort|length }}",
        "{{ ([[0]] * 1000)|batch(100000000)|list|length }}",
        "{{ [0]|slice(100000000)|length }}",
        "{% set a = [1] * 600000 %}{{ a|zip(a)|list|length }}",
    ] {
        template_stops_at(template, "MAX_TEMPLATE_LIST_ITEMS");
    }
}

/// Renders `template`, which must succeed quickly and within the 64 MB bound, and returns the
/// output.
fn template_renders_quickly(template: &str) -> String {
    let start = Instant::now();
    let (result, largest) = largest_allocation(|| render(template, &[user("x")], "", "", true));
    let out = result.unwrap_or_else(|e| panic!("{template}: {e:#}"));
    println!(
        "{template}\n  rendered in {:?}, largest allocation {largest}",
        start.elapsed()
    );
    assert!(
        largest <= allocation_bound(template.len()),
        "{template}: largest allocation {largest} bytes"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "{template}");
    out
}

#[test]
fn chat_template_empty_lists_stay_cheap() {
    // An empty list doubled 60 times holds nothing but would be a chain of 2^60 links, and
    // `[] * n` a walk of n steps.
    let out = template_renders_quickly(
        "{% set ns = namespace(s=[]) %}{% for i in range(60) %}\
         {% set ns.s = ns.s + ns.s %}{% set ns.s = ns.s|chain(ns.s) %}{% endfor %}\
         {{ ns.s|length }} {{ ns.s|list }} {{ 1 in ns.s }}\
         {% set n = 1000000000000 %}{{ ([] * n)|list }}{{ 1 in [] * n }}",
    );
    assert_eq!(out, "0 [] False[]False");
    // Python counts an empty string between each two characters; minijinja-contrib looped.
    assert_eq!(template_renders_quickly("{{ 'abc'.count('') }}"), "4");
}

/// Work inside instructions, which fuel counts as one each: a bounded copy, walk or comparison
/// repeated as often as the fuel allows ran for hours. Each of these stopped within 0.4 s on 2
/// shared cores; 5 s is the hang guard.
#[test]
fn chat_template_work_is_capped() {
    for template in [
        // A list at the list limit copied 100,000 times (96 ms a round).
        "{% set a = [0] * 1000000 %}{% for i in range(100000) %}{% set b = a|list %}{% endfor %}",
        // A string of 16 MB copied 100,000 times (24 ms a round with `~`, 8 ms with `+`).
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s ~ 'y' %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s + 'y' %}\
         {% endfor %}",
        // A one-item slice of a list at the limit, made over and over: each skips a million
        // items.
        "{% set a = [0] * 1000000 %}{% for i in range(100000) %}{% set s = a[999999:] %}\
         {% endfor %}",
        // A list grown one item at a time (86 s): each `+` copies it.
        "{% set ns = namespace(s=[]) %}{% for i in range(100000) %}\
         {% set ns.s = ns.s + [i] %}{% endfor %}{{ ns.s|length }}",
        // The same through `chain`.
        "{% set ns = namespace(s=[0]) %}{% for i in range(100000) %}\
         {% set ns.s = ns.s|chain([i]) %}{% endfor %}{{ ns.s|length }}",
        // Walks and comparisons of large values, each one instruction.
        "{% set a = [0] * 1000000 %}{% for i in range(100000) %}{% set t = 1 in a %}{% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s == s %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = [s] < [s] %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{{ s in [s] * 1000000 }}",
        "{{ (['x' * 16000000] * 1000000)|sort|length }}",
        "{% set s = 'x' * 16000000 %}{{ ([s] * 1000000)|select('eq', s)|list|length }}",
        // Indexing by walking: a lazy list, a string, and a map compares its keys.
        "{% set a = [0] * 1000000 %}{% for i in range(100000) %}{% set t = a[999999] %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s[-1] %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% set d = {s: 1} %}{% for i in range(100000) %}\
         {% set t = d[s] %}{% endfor %}",
        // Strings taken apart character by character, 16 MB at a time.
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s|title %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s[::-1] %}\
         {% endfor %}",
        "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% set t = s|tojson %}\
         {% endfor %}",
        // A list written out as text (300,000 items, 900 KB a round).
        "{% set a = [0] * 300000 %}{% for i in range(100000) %}{% set t = a ~ '' %}{% endfor %}",
    ] {
        template_stops_within(template, "MAX_TEMPLATE_WORK", Duration::from_secs(5));
    }
}

/// minijinja's lazy lists, built on other lazy lists, walked in far more than their length or
/// nested past the stack. Collected as they are made, these render at once.
#[test]
fn chat_template_lazy_lists_stay_cheap() {
    // A one-item slice of a list at the limit doubled 10 times: 1,024 slices that each skipped
    // a million items at every walk (82 s).
    let start = Instant::now();
    let out = template_renders_quickly(
        "{% set a = [0] * 1000000 %}{% set ns = namespace(s=a[999999:]) %}\
         {% for i in range(10) %}{% set ns.s = ns.s + ns.s %}{% endfor %}\
         {{ ns.s|length }} {{ ns.s|list|length }} {{ ns.s|sum }}",
    );
    assert_eq!(out, "1024 1024 0");
    assert!(start.elapsed() < Duration::from_secs(5));
    // A list repeated once, 100,000 times over: a repeat of a repeat, nested 100,000 deep,
    // overflowed the stack when walked.
    let start = Instant::now();
    let out = template_renders_quickly(
        "{% set ns = namespace(s=[0]) %}{% for i in range(100000) %}\
         {% set ns.s = ns.s * 1 %}{% endfor %}{{ ns.s|list }}",
    );
    assert_eq!(out, "[0]");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn chat_template_collected_text_is_capped() {
    for template in [
        // A macro's output is collected into a string; this one doubles it at each call.
        "{% macro twice(n) %}{% if n %}{% set t = twice(n - 1) %}{{ t }}{{ t }}\
         {% else %}x{% endif %}{% endmacro %}{{ twice(40)|length }}",
        // Template text collected by a set block, 240 thousand times over within the fuel.
        "{% set x %}{% for i in range(100000) %}{% for j in range(100) %}\
         0123456789012345678901234567890123456789012345678901234567890123456789\
         {% endfor %}{% endfor %}{% endset %}{{ x|length }}",
    ] {
        template_stops_at(template, "MAX_TEMPLATE_OUTPUT_BYTES");
    }
}

// ---- 7: tokenizer.json files that make the tokenizers crate panic ----

/// Writes the tiny model with `tokenizer` as its tokenizer.json and returns the load error.
fn tokenizer_load_error(tokenizer: &Value) -> String {
    let dir = tiny_hf_dir();
    write_json(&dir.path().join("tokenizer.json"), tokenizer);
    let err = load_fails_fast(dir.path(), dir_bytes(dir.path()), Duration::from_secs(2));
    assert_contains(&err, &["tokenizer.json", "the tokenizer crashed"]);
    err
}

const LLAMA_DECODER: &str = r#"{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}"#;

#[test]
fn tokenizer_json_with_one_corrupted_byte_in_the_decoder() {
    let mut tok = tokenizer_json(&["a", "b"], false);
    // Llama 2's decoder with one digit changed: Strip then cuts 9 characters off the end of
    // strings that are shorter.
    let corrupted = LLAMA_DECODER.replace(r#""stop":0"#, r#""stop":9"#);
    assert_eq!(corrupted.len(), LLAMA_DECODER.len());
    tok["decoder"] = serde_json::from_str(&corrupted).unwrap();
    let err = tokenizer_load_error(&tok);
    assert_contains(&err, &["index out of bounds"]);
}

#[test]
fn template_processing_with_an_undefined_special_token() {
    let mut tok = tokenizer_json(&["a", "b"], true);
    tok["post_processor"]["special_tokens"] = json!({});
    let err = tokenizer_load_error(&tok);
    assert_contains(&err, &["no entry found for key"]);
}

#[test]
fn template_processing_single_with_sequence_b() {
    let mut tok = tokenizer_json(&["a", "b"], true);
    tok["post_processor"]["single"] = json!([
        {"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
        {"Sequence": {"id": "B", "type_id": 0}}
    ]);
    let err = tokenizer_load_error(&tok);
    assert_contains(&err, &["index out of bounds"]);
}

#[test]
fn bpe_prefix_longer_than_a_merged_token() {
    let mut tok = tokenizer_json(&[], false);
    tok["pre_tokenizer"] = Value::Null;
    tok["model"] = json!({
        "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "####",
        "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
        "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5},
        "merges": ["a b"]
    });
    let err = tokenizer_load_error(&tok);
    assert_contains(&err, &["out of bounds"]);
}

fn fuse_then_strip() -> Value {
    let mut tok = tokenizer_json(&["a", "b"], false);
    tok["decoder"] = json!({"type": "Sequence", "decoders": [
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 0, "stop": 1}]});
    tok
}

#[test]
fn strip_after_fuse_is_caught_at_load() {
    tokenizer_load_error(&fuse_then_strip());
}

#[test]
fn strip_after_fuse_at_the_first_generated_token() {
    // Built directly, as if the load-time probe had missed it: decoding must still give an
    // error naming the file, not a panic.
    let inner: tokenizers::Tokenizer = fuse_then_strip().to_string().parse().unwrap();
    let tok = Tokenizer {
        inner,
        source: "/models/x/tokenizer.json".into(),
        bos_token_id: None,
        eos_token_ids: vec![2],
        add_bos: false,
        chat_template: None,
    };
    let err = format!("{:#}", tok.decode(&[0]).unwrap_err());
    assert_contains(
        &err,
        &["/models/x/tokenizer.json", "crashed while decoding", "[0]"],
    );
    assert_eq!(tok.decode(&[3]).unwrap(), "a");
}

#[test]
fn binary_shows_no_panic_for_a_crashing_tokenizer() {
    let dir = tiny_hf_dir();
    write_json(&dir.path().join("tokenizer.json"), &fuse_then_strip());
    let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(["run", "--device", "cpu", "-n", "2", "--model"])
        .arg(dir.path())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_contains(&stderr, &["tokenizer.json", "the tokenizer crashed"]);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
}

// ---- 8, 9: downloads and the cache ----

const CONTENT: &[u8] = b"pretend these are 64 bytes of a model file, checked by SHA-256.";

fn artifact(sha: &'static str) -> Artifact<'static> {
    Artifact {
        file_name: "model.gguf",
        size: CONTENT.len() as u64,
        sha256: sha,
    }
}

fn content_sha() -> &'static str {
    use sha2::Digest;
    let d = sha2::Sha256::digest(CONTENT);
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    Box::leak(hex.into_boxed_str())
}

/// Left-overs in `dir` besides the model and its stamp.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "model.gguf" && n != "model.gguf.verified")
        .collect()
}

#[test]
fn a_fetch_is_verified_and_cached() {
    let dir = tempfile::tempdir().unwrap();
    let a = artifact(content_sha());
    let path = ensure_cached(dir.path(), &a, |_, part| {
        std::fs::write(part, CONTENT)?;
        Ok(())
    })
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
    assert!(dir.path().join("model.gguf.verified").is_file());
    assert!(leftovers(dir.path()).is_empty());
    // Cached and stamped: no fetch.
    let again = ensure_cached(dir.path(), &a, |_, _| panic!("fetched again")).unwrap();
    assert_eq!(again, path);
}

#[test]
fn an_interrupted_fetch_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a = artifact(content_sha());
    let err = ensure_cached(dir.path(), &a, |scratch, part| {
        std::fs::write(scratch.join("wheel.whl"), vec![7u8; 4096])?;
        std::fs::write(part, &CONTENT[..10])?;
        anyhow::bail!("connection reset")
    })
    .unwrap_err();
    assert_contains(&format!("{err:#}"), &["connection reset"]);
    assert!(!dir.path().join("model.gguf").exists());
    assert_eq!(leftovers(dir.path()), Vec::<String>::new());
}

#[test]
fn a_fetch_with_the_wrong_hash_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = artifact(content_sha());
    let err = ensure_cached(dir.path(), &a, |_, part| {
        let mut bad = CONTENT.to_vec();
        bad[0] ^= 1;
        std::fs::write(part, bad)?;
        Ok(())
    })
    .unwrap_err();
    assert_contains(&format!("{err:#}"), &["SHA-256", "refusing it"]);
    assert!(!dir.path().join("model.gguf").exists());
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_corrupted_cached_file_is_fetched_again() {
    let dir = tempfile::tempdir().unwrap();
    let a = artifact(content_sha());
    let fetch_good = |_: &Path, part: &Path| {
        std::fs::write(part, CONTENT)?;
        Ok(())
    };
    let path = ensure_cached(dir.path(), &a, fetch_good).unwrap();
    // Same size, last bytes zeroed (the mtime changes, so the stamp no longer vouches for it).
    std::thread::sleep(Duration::from_millis(20));
    let mut bad = CONTENT.to_vec();
    let n = bad.len();
    bad[n - 8..].fill(0);
    std::fs::write(&path, &bad).unwrap();
    let err = format!("{:#}", verify_cached(&path, &a).unwrap_err());
    assert_contains(&err, &["model.gguf", "is corrupt", "SHA-256"]);
    let mut fetched = false;
    ensure_cached(dir.path(), &a, |s, p| {
        fetched = true;
        fetch_good(s, p)
    })
    .unwrap();
    assert!(fetched);
    assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
}

#[test]
fn a_corrupted_cached_file_that_cannot_be_refetched_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    let a = artifact(content_sha());
    std::fs::write(dir.path().join("model.gguf"), vec![0u8; CONTENT.len()]).unwrap();
    let err = ensure_cached(dir.path(), &a, |_, _| anyhow::bail!("no network")).unwrap_err();
    let err = format!("{err:#}");
    assert_contains(
        &err,
        &["model.gguf is corrupt", "it was deleted", "no network"],
    );
}

#[test]
fn left_overs_of_dead_runs_are_removed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    // No process has this id (above Linux's pid_max), so these belong to a run that died.
    std::fs::create_dir(dir.path().join("download-999999999-ThreadId2")).unwrap();
    std::fs::write(
        dir.path()
            .join("download-999999999-ThreadId2")
            .join("x.whl"),
        b"wheel",
    )
    .unwrap();
    std::fs::write(dir.path().join("model.gguf.999999999-ThreadId2.part"), b"p").unwrap();
    // Ours: alive, so left alone.
    let live = format!("download-{}-ThreadId9", std::process::id());
    std::fs::create_dir(dir.path().join(&live)).unwrap();
    assert_eq!(clean_stale_downloads(dir.path()), 2);
    assert_eq!(leftovers(dir.path()), vec![live]);
}

#[cfg(target_os = "linux")]
#[test]
fn a_download_child_dies_with_its_parent() {
    use std::os::unix::process::ExitStatusExt;
    // The child is tied to the thread that spawns it; when that thread ends (as when the whole
    // process is killed), the kernel kills the child.
    let mut child = std::thread::spawn(|| {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        megainfer::fetch::die_with_this_thread(&mut cmd);
        cmd.spawn().unwrap()
    })
    .join()
    .unwrap();
    let start = Instant::now();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

// ---- 10: the CLI and the safetensors diagnosis ----

fn megainfer(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn negative_temperature_is_a_value_not_a_flag() {
    let (code, err) = megainfer(&["run", "--temperature", "-1", "--model", "/nonexistent"]);
    assert_eq!(code, Some(1), "{err}");
    assert_contains(
        &err,
        &["--temperature must be a finite number >= 0 (got -1)"],
    );
}

#[test]
fn bench_output_paths_are_checked_before_running() {
    let (code, err) = megainfer(&["bench", "--json", "/nonexistent/dir/report.json"]);
    assert_eq!(code, Some(1), "{err}");
    assert_contains(
        &err,
        &["--json /nonexistent/dir/report.json", "cannot create"],
    );
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = megainfer(&["bench", "--json", dir.path().to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert_contains(&err, &["is a directory"]);
}

#[test]
fn bench_max_context_must_hold_the_run() {
    let (code, err) = megainfer(&[
        "bench",
        "--preset",
        "smollm2-135m",
        "--prompt-len",
        "32",
        "--gen",
        "8",
        "--max-context",
        "40",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert_contains(&err, &["--max-context 40", "--prompt-len + --gen + 1 = 41"]);
}

#[test]
fn bench_prefill_chunk_must_be_positive() {
    let (code, err) = megainfer(&["bench", "--prefill-chunk", "0"]);
    assert_eq!(code, Some(2), "{err}");
    assert_contains(&err, &["--prefill-chunk", "0 is not in 1..=1048576"]);
}

#[test]
fn safetensors_offsets_that_overflow_are_diagnosed() {
    let dir = tiny_hf_dir();
    let header = json!({"model.embed_tokens.weight":
        {"dtype": "F32", "shape": [1], "data_offsets": [0, u64::MAX / 4]}})
    .to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let err = load_fails_fast(dir.path(), dir_bytes(dir.path()), Duration::from_secs(2));
    assert_contains(
        &err,
        &[
            "model.safetensors",
            "model.embed_tokens.weight",
            "data_offsets",
        ],
    );
}
