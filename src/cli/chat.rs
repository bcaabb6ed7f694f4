//! `megainfer chat`: a multi-turn conversation in the model's chat template that keeps its KV
//! cache between turns, so each turn prefills only its own tokens.
//!
//! Each turn renders the whole conversation through the template and compares the token ids
//! with those already fed. Templates are not always prefix-stable (a date stamp, a stripped
//! reply, a reply the model tokenised differently from how its text re-encodes): then the cache
//! is rewound to the first differing token and the rest is fed again, which costs one longer
//! prefill but never leaves the cache disagreeing with the rendering.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{bail, Context, Result};

use super::run::{choose_gpu, context_limit, upload_for_path, ModelArgs};
use crate::generate::{generate_after, Backend};
use crate::gpu::paths::GpuPath;
use crate::reference::CpuForward;
use crate::sampling::Sampler;
use crate::tokenizer::chat::{render_ids, ChatMessage};
use crate::tokenizer::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub common: ModelArgs,
    /// Maximum number of new tokens per reply.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub max_tokens: usize,
    /// System message opening the conversation (default: none, or the template's own).
    #[arg(long)]
    pub system: Option<String>,
    /// After each turn, say on stderr how many tokens were fed and how many came from the cache.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Instead of streaming replies, print one JSON object per event on stdout: a turn (user,
    /// reply, generated_ids with any eos, stop_reason, prompt_tokens, reused, prefilled,
    /// rewound, context_used, max_context), {"event":"reset"}, or {"event":"context_full",...}.
    #[arg(long)]
    pub json: bool,
}

/// The longest conversation the megakernel's schedule is costed for (see `run`).
const CHAT_SCHEDULE_CONTEXT: usize = 4096;

pub fn run(args: &ChatArgs) -> Result<()> {
    let params = args.common.sampling.params(args.common.seed)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1 for a chat");
    }
    let model = args.common.load_model()?;
    let tok = model
        .tokenizer
        .as_ref()
        .context("this model has no tokenizer (no tokenizer.json / GGUF tokenizer metadata)")?;
    if tok.chat_template.is_none() {
        bail!("{}: this model has no chat template", tok.source);
    }
    let gpu = choose_gpu(args.common.device)?;
    let max_context = context_limit(args.common.max_context, &model, gpu.as_ref())?;
    if max_context < 2 {
        bail!("--max-context {max_context}: a chat needs at least 2 tokens of context");
    }
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let mut session = Session::new(args, tok, max_context, Sampler::new(params));
    if let Some(gpu) = gpu {
        let (path, dm) = upload_for_path(
            &gpu,
            &model.config,
            &model.weights,
            &args.common,
            max_context,
            "chat",
        )?;
        // The megakernel's schedule is costed at the length a conversation is expected to reach:
        // all of the context, up to CHAT_SCHEDULE_CONTEXT. Costed at a 128K-token context, every
        // short turn would pay for attention split into many parts; a conversation that runs
        // longer stays correct, with fewer parts than its length would want.
        let expected = max_context.min(CHAT_SCHEDULE_CONTEXT);
        let mut backend = GpuPath::new(path, &gpu, &dm, max_context, expected)?;
        backend.set_tokens_per_launch(args.common.steps_per_launch());
        backend.prepare_prefill()?;
        backend.prepare_sampling(&params)?;
        return session.run(&mut backend, stdin.lock(), interactive);
    }
    eprintln!(
        "megainfer: chat on the CPU ({} threads)",
        rayon::current_num_threads()
    );
    let mut backend = CpuForward::new(&model.config, &model.weights, max_context);
    session.run(&mut backend, stdin.lock(), interactive)
}

/// One conversation: its messages and the token ids in the backend's KV cache.
struct Session<'a> {
    args: &'a ChatArgs,
    tok: &'a Tokenizer,
    max_context: usize,
    sampler: Sampler,
    messages: Vec<ChatMessage>,
    /// Token ids at positions `0..fed.len()` of the cache.
    fed: Vec<u32>,
}

impl<'a> Session<'a> {
    fn new(args: &'a ChatArgs, tok: &'a Tokenizer, max_context: usize, sampler: Sampler) -> Self {
        let mut s = Self {
            args,
            tok,
            max_context,
            sampler,
            messages: Vec::new(),
            fed: Vec::new(),
        };
        s.clear();
        s
    }

    fn clear(&mut self) {
        self.messages.clear();
        self.fed.clear();
        if let Some(system) = &self.args.system {
            self.messages
                .push(ChatMessage::new("system", system.clone()));
        }
    }

    fn run(
        &mut self,
        backend: &mut dyn Backend,
        input: impl BufRead,
        interactive: bool,
    ) -> Result<()> {
        if interactive {
            eprintln!("Type a message; /reset starts a new conversation, /exit (or Ctrl-D) ends.");
        }
        let mut lines = input.lines();
        loop {
            if interactive {
                eprint!("> ");
                std::io::stderr().flush()?;
            }
            let Some(line) = lines.next() else { break };
            let line = line.context("reading stdin")?;
            let text = line.trim_end_matches('\r');
            match text.trim() {
                "" => continue,
                "/exit" | "/quit" => break,
                "/reset" => {
                    self.clear();
                    backend.rewind(0)?;
                    if self.args.json {
                        println!("{}", serde_json::json!({"event": "reset"}));
                    }
                    eprintln!(
                        "[conversation cleared; context: 0/{} tokens]",
                        self.max_context
                    );
                }
                cmd if cmd.starts_with('/') && !cmd.contains(char::is_whitespace) => {
                    eprintln!(
                        "[unknown command {cmd}: /reset clears the conversation, /exit ends]"
                    );
                }
                _ => self.turn(backend, text)?,
            }
        }
        Ok(())
    }

    /// One user message and the streamed reply.
    fn turn(&mut self, backend: &mut dyn Backend, text: &str) -> Result<()> {
        self.messages.push(ChatMessage::new("user", text));
        let ids = render_ids(self.tok, &self.messages, true)?;
        if ids.len() >= self.max_context {
            // The message is dropped, so the conversation stays as it was and /reset (or a
            // shorter message) can go on.
            self.messages.pop();
            if self.args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "event": "context_full",
                        "tokens": ids.len(),
                        "max_context": self.max_context,
                    })
                );
            }
            eprintln!(
                "[context full: the conversation with this message is {} tokens, the limit is {} \
                 (--max-context); the message was not sent. Type /reset to start a new \
                 conversation]",
                ids.len(),
                self.max_context
            );
            return Ok(());
        }
        let same = self
            .fed
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        // Something must be fed to get the logits of the next token.
        let reuse = same.min(ids.len() - 1);
        let rewound = reuse < self.fed.len();
        if rewound {
            eprintln!(
                "[the template renders the earlier conversation differently from token {reuse} \
                 on ({} tokens were cached): feeding again from there]",
                self.fed.len()
            );
            backend.rewind(reuse)?;
            self.fed.truncate(reuse);
        }
        let new = &ids[reuse..];
        let budget = self.args.max_tokens.min(self.max_context - ids.len());
        let eos = &self.tok.eos_token_ids;
        let mut generated: Vec<u32> = Vec::new();
        let mut printer = (!self.args.json).then(|| Printer::new(self.tok));
        let stats = generate_after(
            backend,
            &self.fed,
            new,
            budget,
            eos,
            &mut self.sampler,
            &mut |t| {
                generated.push(t);
                match &mut printer {
                    Some(p) if !eos.contains(&t) => p.push(t),
                    _ => Ok(()),
                }
            },
        )?;
        // Everything but the last generated token went through the model.
        self.fed.extend_from_slice(new);
        self.fed
            .extend_from_slice(&generated[..generated.len().saturating_sub(1)]);
        let text_ids: Vec<u32> = generated
            .iter()
            .copied()
            .filter(|t| !eos.contains(t))
            .collect();
        let reply = self.tok.decode(&text_ids)?;
        self.messages
            .push(ChatMessage::new("assistant", reply.clone()));
        let used = ids.len() + generated.len();
        let stop_reason = match stats.stop_reason() {
            "max_tokens" if budget < self.args.max_tokens => "context_full",
            reason => reason,
        };
        if self.args.json {
            println!(
                "{}",
                serde_json::json!({
                    "user": text,
                    "reply": reply,
                    "generated_ids": generated,
                    "stop_reason": stop_reason,
                    "prompt_tokens": ids.len(),
                    "reused": reuse,
                    "prefilled": new.len(),
                    "rewound": rewound,
                    "context_used": used,
                    "max_context": self.max_context,
                })
            );
        } else {
            println!();
        }
        if self.args.verbose {
            eprintln!(
                "[prefill: {} new tokens, {reuse} reused from the cache | {:.1} ms to the first \
                 token | {} generated at {:.1} tok/s]",
                new.len(),
                stats.time_to_first_token.as_secs_f64() * 1e3,
                stats.generated,
                stats.decode_tokens_per_s()
            );
        }
        eprintln!("[context: {used}/{} tokens]", self.max_context);
        if stop_reason == "interrupted" {
            eprintln!("[reply interrupted (Ctrl-C); Ctrl-C at the prompt ends the chat]");
        }
        if stop_reason == "context_full" {
            eprintln!(
                "[the reply was cut off: the context of {} tokens is full (--max-context). Type \
                 /reset to start a new conversation]",
                self.max_context
            );
        }
        Ok(())
    }
}

/// Streams a reply's text to stdout token by token.
struct Printer<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    /// Decoding only from `prefix` keeps each step O(1); the tokens between `prefix` and
    /// `printed` are context, since byte-level tokens decode correctly only with neighbours.
    prefix: usize,
    printed: usize,
}

impl<'a> Printer<'a> {
    fn new(tok: &'a Tokenizer) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            prefix: 0,
            printed: 0,
        }
    }

    fn push(&mut self, t: u32) -> Result<()> {
        self.ids.push(t);
        let before = self.tok.decode(&self.ids[self.prefix..self.printed])?;
        let text = self.tok.decode(&self.ids[self.prefix..])?;
        // A token may end inside a multi-byte character: wait for the rest of it.
        if !text.ends_with('\u{FFFD}')
            && text.len() > before.len()
            && text.is_char_boundary(before.len())
        {
            let mut out = std::io::stdout().lock();
            out.write_all(&text.as_bytes()[before.len()..])?;
            out.flush()?;
            self.prefix = self.printed;
            self.printed = self.ids.len();
        }
        Ok(())
    }
}
