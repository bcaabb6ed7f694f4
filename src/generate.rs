//! The decode loop shared by every execution path: prompt in, tokens out, timings kept.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::reference::CpuForward;
use crate::sampling::{argmax, Sampler};

/// One execution path (CPU reference, megakernel, graph, eager) holding a sequence's state.
pub trait Backend {
    /// Feeds tokens at the next positions and returns the f32 logits after the last one.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;

    /// Drops the cached positions from `len` on, so the next token fed goes to position `len`
    /// (a chat whose re-rendered history differs from what was fed continues from there).
    fn rewind(&mut self, len: usize) -> Result<()>;

    /// Feeds one token and returns the greedy next token. GPU paths override this so the
    /// logits never leave the device.
    fn feed_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(argmax(&self.feed(&[token])?))
    }

    /// Feeds one token and returns the next one `sampler` draws; the sampler's context already
    /// ends with `token`. GPU paths with a device sampler override this so the logits never
    /// leave the device.
    fn feed_sampled(&mut self, token: u32, sampler: &Sampler) -> Result<u32> {
        Ok(sampler.sample(&self.feed(&[token])?))
    }

    /// Generates up to `max` tokens after `first`, which is fed first (`sampler`'s context
    /// already ends with it), handing each to `on` as soon as it exists; `on` returns whether
    /// to go on, and returns false after any token of `stop` (the generation's end tokens,
    /// which a path may also check on the device). Afterwards the last token handed over is
    /// not fed. GPU paths override this to keep steps queued ahead of the host's work per
    /// token, or to run the whole generation in one launch.
    fn decode_stream(
        &mut self,
        first: u32,
        max: usize,
        stop: &[u32],
        sampler: &mut Sampler,
        on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        let _ = stop;
        decode_one_by_one(self, first, max, sampler, on)
    }
}

/// [`Backend::decode_stream`] one step at a time: each token is fed only once `on` has taken
/// the one before.
pub fn decode_one_by_one<B: Backend + ?Sized>(
    backend: &mut B,
    first: u32,
    max: usize,
    sampler: &mut Sampler,
    on: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    let greedy = sampler.params().is_greedy();
    let mut token = first;
    for k in 0..max {
        token = if greedy {
            backend.feed_greedy(token)?
        } else {
            backend.feed_sampled(token, sampler)?
        };
        if !on(token)? || k + 1 == max {
            break;
        }
        sampler.accept(&[token]);
    }
    Ok(())
}

impl Backend for CpuForward<'_> {
    /// A prompt goes through batched prefill; one token at a time, the plain forward.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() > 1 {
            self.prefill(tokens, crate::reference::prefill::DEFAULT_CHUNK)
        } else {
            self.forward(tokens)
        }
    }

    fn rewind(&mut self, len: usize) -> Result<()> {
        if len > self.len() {
            bail!(
                "cannot rewind to position {len}: only {} tokens are cached",
                self.len()
            );
        }
        self.truncate(len);
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    pub time_to_first_token: Duration,
    /// Time spent producing tokens 2..n (one forward step each).
    pub decode_time: Duration,
    pub stopped_on_eos: bool,
    /// Stopped by Ctrl-C (see [`crate::interrupt`]).
    pub interrupted: bool,
}

impl GenerationStats {
    /// Why the generation ended: `eos`, `interrupted` (Ctrl-C) or `max_tokens` (the budget).
    pub fn stop_reason(&self) -> &'static str {
        if self.stopped_on_eos {
            "eos"
        } else if self.interrupted {
            "interrupted"
        } else {
            "max_tokens"
        }
    }

    /// Prompt tokens per second of the time to first token (prefill, LM head and the first
    /// sample).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        if self.time_to_first_token.is_zero() {
            return 0.0;
        }
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64()
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        let steps = self.generated.saturating_sub(1);
        if steps == 0 || self.decode_time.is_zero() {
            return 0.0;
        }
        steps as f64 / self.decode_time.as_secs_f64()
    }
}

/// Generates up to `max_tokens` after `prompt`, calling `on_token` with each new token as soon
/// as it exists. Stops after an eos token (which is passed to `on_token` too).
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_tokens: usize,
    eos: &[u32],
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationStats> {
    generate_after(backend, &[], prompt, max_tokens, eos, sampler, on_token)
}

/// [`generate`] for a sequence whose first tokens, `cached`, are already in the backend's KV
/// cache (an earlier turn of a chat): only `prompt` is fed, while the sampler sees the whole
/// sequence, so its repetition penalty and the positions its draws are keyed by are those of
/// one uninterrupted run. The last generated token (an eos included) is not fed.
pub fn generate_after(
    backend: &mut dyn Backend,
    cached: &[u32],
    prompt: &[u32],
    max_tokens: usize,
    eos: &[u32],
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationStats> {
    let start = Instant::now();
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated: 0,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
        stopped_on_eos: false,
        interrupted: false,
    };
    if max_tokens == 0 {
        return Ok(stats);
    }
    let generating = crate::interrupt::Generating::begin();
    sampler.reset();
    sampler.accept(cached);
    sampler.accept(prompt);
    let logits = backend.feed(prompt)?;
    let first = sampler.sample(&logits);
    stats.time_to_first_token = start.elapsed();
    let decode_start = Instant::now();
    // Takes each new token; false once the generation is over.
    let mut take = |token: u32| -> Result<bool> {
        stats.generated += 1;
        on_token(token)?;
        if eos.contains(&token) {
            stats.stopped_on_eos = true;
            return Ok(false);
        }
        if stats.generated == max_tokens {
            return Ok(false);
        }
        if generating.stop_requested() {
            stats.interrupted = true;
            return Ok(false);
        }
        Ok(true)
    };
    if take(first)? {
        sampler.accept(&[first]);
        backend.decode_stream(first, max_tokens - 1, eos, sampler, &mut take)?;
    }
    stats.decode_time = decode_start.elapsed();
    Ok(stats)
}
