//! What every GPU decode path shares: the sequence position, feeding a prompt (batched
//! prefill, or one step per token), and greedy decoding back to back with the chosen tokens
//! left on the device.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;

use super::device::Gpu;
use super::model::DeviceModel;
use super::prefill::{KvTarget, Logits, Prefill, DEFAULT_CHUNK};
use crate::generate::Backend;
use crate::sampling::{Sampler, SamplingParams};

/// What a generation inside launches did: the tokens handed to the host's callback, the
/// steps the device ran (more when steps were running as the host asked it to stop) and the
/// last token handed on.
#[derive(Clone, Copy, Debug)]
pub struct GenerationRun {
    pub handled: usize,
    pub ran: usize,
    pub last: Option<u32>,
}

/// Position bookkeeping of one sequence.
pub struct Sequence {
    /// Tokens already in the KV cache: the position of the next one.
    pub pos: usize,
    pub max_seq: usize,
    /// Set when the device's token meta already holds (this token, `pos`), as the argmax of
    /// the last greedy step left it: then the host writes nothing before the next step.
    pub meta_current: Option<u32>,
    /// Whether the device history holds the true token at every position before `pos` (as
    /// the device sampler's repetition penalty reads it): false after host-fed steps, whose
    /// greedy argmax overwrote it.
    pub history_synced: bool,
    /// The batched-prefill engine, made for the first prompt that uses it.
    pub prefill: Option<Prefill>,
    /// Tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Feeds of at least this many tokens go through batched prefill; shorter ones (a
    /// sampled token) are decode steps. `usize::MAX` feeds every prompt one step per token.
    pub prefill_min: usize,
    /// Greedy steps per launch on paths that run a generation inside one launch (the
    /// megakernel): `usize::MAX` (the default) the whole generation, 1 a launch per step.
    pub tokens_per_launch: usize,
}

impl Sequence {
    pub fn new(max_seq: usize) -> Self {
        Self {
            pos: 0,
            max_seq,
            meta_current: None,
            history_synced: false,
            prefill: None,
            prefill_chunk: DEFAULT_CHUNK,
            prefill_min: 2,
            tokens_per_launch: usize::MAX,
        }
    }

    /// Starts a new sequence (the KV cache is simply overwritten).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.meta_current = None;
        self.history_synced = false;
    }

    /// Drops the positions from `len` on (their K/V are overwritten by the next tokens).
    pub fn rewind(&mut self, len: usize) -> Result<()> {
        if len > self.pos {
            bail!(
                "cannot rewind to position {len}: only {} tokens are cached",
                self.pos
            );
        }
        self.pos = len;
        self.meta_current = None;
        self.history_synced = false;
        Ok(())
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if self.pos + n > self.max_seq {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens (--max-context)",
                self.pos + n,
                self.max_seq
            );
        }
        Ok(())
    }
}

/// One decode step on the device, for token and position read from a device buffer.
pub trait Steps {
    fn gpu(&self) -> &Gpu;
    fn vocab(&self) -> u32;
    fn seq(&mut self) -> &mut Sequence;
    /// Makes (token, pos) the input of the next step.
    fn write_meta(&mut self, token: u32, pos: usize) -> Result<()>;
    fn launch_step(&mut self) -> Result<()>;
    /// Reports failures the steps recorded on the device.
    fn check(&self) -> Result<()>;
    /// `history[p + 1]` = the greedy token chosen after position `p`.
    fn history(&self) -> &CudaSlice<u32>;
    fn logits(&self) -> &CudaSlice<f32>;
    /// Readies the device sampler for `p`; false when the path has none (the host samples).
    fn prepare_sampling(&mut self, _p: &SamplingParams) -> Result<bool> {
        Ok(false)
    }
    /// One step whose token is drawn on the device (after `prepare_sampling` returned true).
    fn launch_sampled_step(&mut self) -> Result<()> {
        bail!("this path has no device sampler")
    }
    fn history_mut(&mut self) -> Option<&mut CudaSlice<u32>> {
        None
    }
    /// Whether greedy steps run as generations, many to a launch (`generate_in_launch`).
    fn runs_generations(&self) -> bool {
        false
    }
    /// Whether device-sampled steps draw inside the step's own launch (after
    /// `prepare_sampling` returned true), so that they run as generations too.
    fn samples_in_launch(&self) -> bool {
        false
    }
    /// Up to `n` greedy (or, with `sampled`, device-sampled) steps from the token meta, run
    /// inside launches, each token handed to `on` as the device publishes it (`on` returns
    /// whether to go on); the device stops after a token of `stop`. The caller advances the
    /// sequence by what the run reports.
    fn generate_in_launch(
        &mut self,
        _n: usize,
        _stop: &[u32],
        _sampled: bool,
        _on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<GenerationRun> {
        bail!("this path runs one launch per step")
    }
    /// The weights the steps read.
    fn model(&self) -> &DeviceModel;
    /// The path's KV cache and its layout, which prefill writes into.
    fn kv_target(&self) -> KvTarget;
}

/// Every id must index the embedding table (`model::check_tokens`).
fn check_tokens(tokens: &[u32], vocab: u32) -> Result<()> {
    crate::model::check_tokens(tokens, vocab as usize)
}

/// Feeds `tokens`, as batched prefill when there are at least `prefill_min` of them, else one
/// step each; the f32 logits after the last.
pub fn feed<S: Steps>(s: &mut S, tokens: &[u32]) -> Result<Vec<f32>> {
    if tokens.len() >= s.seq().prefill_min {
        make_prefill_engine(s);
    }
    if tokens.len() >= s.seq().prefill_min {
        prefill(s, tokens, Logits::Last)
    } else {
        feed_steps(s, tokens)
    }
}

/// Makes the batched-prefill engine if there is none. It needs cuBLAS and a head_dim its
/// attention kernel has; without them prompts still run, one decode step per token, and the
/// user is told why.
fn make_prefill_engine<S: Steps>(s: &mut S) {
    if s.seq().prefill.is_some() || s.seq().prefill_min == usize::MAX {
        return;
    }
    match Prefill::new(s.gpu(), &s.model().config) {
        Ok(engine) => s.seq().prefill = Some(engine),
        Err(e) => {
            eprintln!("megainfer: batched prefill unavailable ({e:#}); feeding prompts one token per step");
            s.seq().prefill_min = usize::MAX;
        }
    }
}

/// Makes the batched-prefill engine and captures its short-prompt graphs now, at load, rather
/// than in the first prompt's time to first token (a capture writes nothing: no position of
/// the cache changes).
pub fn prepare_prefill<S: Steps>(s: &mut S) -> Result<()> {
    make_prefill_engine(s);
    let Some(mut engine) = s.seq().prefill.take() else {
        return Ok(());
    };
    let kv = s.kv_target();
    let chunk = s.seq().prefill_chunk;
    let r = engine.prepare(s.gpu(), s.model(), &kv, chunk);
    s.seq().prefill = Some(engine);
    r
}

/// Feeds `tokens` through batched prefill at the next positions, in chunks of
/// `seq().prefill_chunk` tokens; K/V land in the path's cache, and the next decode step
/// continues from there (its meta is written afresh).
pub fn prefill<S: Steps>(s: &mut S, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
    check_tokens(tokens, s.vocab())?;
    s.seq().check_room(tokens.len())?;
    let (start, chunk) = (s.seq().pos, s.seq().prefill_chunk);
    let mut engine = match s.seq().prefill.take() {
        Some(p) => p,
        None => Prefill::new(s.gpu(), &s.model().config)?,
    };
    let kv = s.kv_target();
    let result = engine.run(s.gpu(), s.model(), &kv, tokens, start, chunk, which);
    let seq = s.seq();
    seq.prefill = Some(engine);
    let logits = result?;
    seq.pos += tokens.len();
    seq.meta_current = None;
    Ok(logits)
}

/// Feeds `tokens` one decode step each; the f32 logits after the last.
pub fn feed_steps<S: Steps>(s: &mut S, tokens: &[u32]) -> Result<Vec<f32>> {
    check_tokens(tokens, s.vocab())?;
    s.seq().check_room(tokens.len())?;
    for &t in tokens {
        let pos = s.seq().pos;
        s.write_meta(t, pos)?;
        s.launch_step()?;
        s.seq().pos += 1;
    }
    s.seq().meta_current = None;
    s.seq().history_synced = false;
    s.check()?;
    Ok(s.gpu().stream.clone_dtoh(s.logits())?)
}

/// All `n` steps from the token meta at `start` as generations inside launches (greedy, or
/// drawn in the launch with `sampled`); the sequence advances by the tokens handed over.
fn generate_all<S: Steps>(s: &mut S, start: usize, n: usize, sampled: bool) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    let run = s.generate_in_launch(n, &[], sampled, &mut |t| {
        out.push(t);
        Ok(true)
    })?;
    end_generation(s, start, &run);
    if run.ran < n {
        bail!("the GPU generation ended after {} of {n} steps", run.ran);
    }
    Ok(out)
}

/// `n` greedy steps from `token` launched back to back: each step's argmax feeds the next on
/// the device, and the host reads the tokens once at the end.
pub fn decode_greedy<S: Steps>(s: &mut S, token: u32, n: usize) -> Result<Vec<u32>> {
    check_tokens(&[token], s.vocab())?;
    s.seq().check_room(n)?;
    let start = s.seq().pos;
    if s.seq().meta_current != Some(token) {
        s.write_meta(token, start)?;
    }
    if n > 1 && s.runs_generations() {
        return generate_all(s, start, n, false);
    }
    for _ in 0..n {
        s.launch_step()?;
    }
    finish_chained(s, start, n, "argmax")
}

/// Advances the sequence past a generation from `start`: by the tokens handed on; the device
/// meta holds the next token to feed only if the device ran no step past them.
fn end_generation<S: Steps>(s: &mut S, start: usize, run: &GenerationRun) {
    let seq = s.seq();
    seq.pos = start + run.handled;
    seq.meta_current = if run.ran == run.handled {
        run.last
    } else {
        None
    };
}

/// The error for a token the device chose outside the vocabulary (`chooser` names what picked
/// it): every logit was NaN.
pub fn out_of_vocabulary(chooser: &str, token: u32) -> anyhow::Error {
    anyhow::anyhow!("GPU {chooser} produced token {token} outside the vocabulary (NaN logits?)")
}

/// After `n` steps chained on the device from position `start`: advances the sequence, checks
/// the kernels' error state and reads back only the n new tokens (the whole history is max_seq
/// words), refusing any outside the vocabulary (`chooser` names what picked them).
fn finish_chained<S: Steps>(s: &mut S, start: usize, n: usize, chooser: &str) -> Result<Vec<u32>> {
    s.seq().pos += n;
    s.check()?;
    let out = s
        .gpu()
        .stream
        .clone_dtoh(&s.history().slice(start + 1..start + 1 + n))?;
    let vocab = s.vocab();
    if let Some(&bad) = out.iter().find(|&&t| t >= vocab) {
        return Err(out_of_vocabulary(chooser, bad));
    }
    s.seq().meta_current = out.last().copied();
    Ok(out)
}

/// `n` sampled steps from `token` launched back to back, each drawn on the device from the
/// step's logits and fed to the next; `sampler`'s context ends with `token`. Paths without a
/// device sampler draw on the host from copied logits instead.
pub fn decode_sampled<S: Steps>(
    s: &mut S,
    sampler: &Sampler,
    token: u32,
    n: usize,
) -> Result<Vec<u32>> {
    check_tokens(&[token], s.vocab())?;
    let ctx = sampler.context();
    let start = s.seq().pos;
    check_sampler_context(sampler, token, start)?;
    if !s.prepare_sampling(sampler.params())? {
        let mut host = Sampler::new(*sampler.params());
        host.accept(ctx);
        let mut t = token;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            t = host.sample(&feed(s, &[t])?);
            host.accept(&[t]);
            out.push(t);
        }
        return Ok(out);
    }
    s.seq().check_room(n)?;
    start_sampled_chain(s, sampler, token)?;
    if n > 1 && s.runs_generations() && s.samples_in_launch() {
        let out = generate_all(s, start, n, true);
        s.seq().history_synced = true;
        return out;
    }
    for _ in 0..n {
        s.launch_sampled_step()?;
    }
    let out = finish_chained(s, start, n, "sampler")?;
    s.seq().history_synced = true;
    Ok(out)
}

/// A sampled step at `start` feeds `token`, which must end the sampler's context (whose
/// positions the draws are keyed by and whose tail the penalty reads).
fn check_sampler_context(sampler: &Sampler, token: u32, start: usize) -> Result<()> {
    let ctx = sampler.context();
    if ctx.last() != Some(&token) || ctx.len() != start + 1 {
        bail!(
            "sampler context ({} tokens) does not end with the token fed at position {start}",
            ctx.len()
        );
    }
    Ok(())
}

/// Makes the device ready for sampled steps chained from `token` at the sequence's position
/// (after `prepare_sampling` returned true): the token meta, and the penalty's window in the
/// device history when the host fed the positions before (the prompt).
fn start_sampled_chain<S: Steps>(s: &mut S, sampler: &Sampler, token: u32) -> Result<()> {
    let start = s.seq().pos;
    if s.seq().meta_current == Some(token) && s.seq().history_synced {
        return Ok(());
    }
    let p = sampler.params();
    if p.penalises() {
        let from = start.saturating_sub(p.repeat_last_n.saturating_sub(1));
        let window = sampler.context()[from..start].to_vec();
        if !window.is_empty() {
            let stream = s.gpu().stream.clone();
            let hist = s.history_mut().expect("a device sampler keeps a history");
            let mut view = hist.slice_mut(from..start);
            stream.memcpy_htod(&window, &mut view)?;
        }
    }
    s.write_meta(token, start)
}

/// Steps a streamed generation keeps queued ahead of the token the host is handling: enough
/// that the GPU never waits for the host's per-token work (reading the token, detokenising,
/// printing, the next launches), few enough that little is computed past a stop.
pub const STREAM_AHEAD: usize = 4;

/// Generates up to `max` tokens after `first` (fed at the sequence's position; `sampler`'s
/// context already ends with it), each handed to `on` as soon as the GPU has it; `on` returns
/// whether to go on. Steps chain on the device (the greedy argmax or the device sampler feeds
/// the next step) and up to [`STREAM_AHEAD`] are queued beyond the token being handled, so the
/// host's work per token overlaps the GPU's instead of leaving it idle between steps. Each
/// token is read on the GPU's copy stream once its step has finished (an event), while the
/// compute stream runs on. Steps queued past a stop computed positions the sequence then drops
/// (their K/V rows are overwritten before anything reads them). Greedy steps on a path that
/// runs generations (the megakernel, unless set to one step per launch) run inside launches
/// instead, each token taken as the device publishes it (`stream_generation`); so do sampled
/// steps on a path that draws inside its launch (the megakernel, `samples_in_launch`). A generation
/// that could pass the context, or a path that samples on the host, goes one step at a time.
pub fn decode_stream<S: Steps>(
    s: &mut S,
    first: u32,
    max: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    on: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    check_tokens(&[first], s.vocab())?;
    let greedy = sampler.params().is_greedy();
    let start = s.seq().pos;
    let chained = greedy || s.prepare_sampling(sampler.params())?;
    if !chained || start + max > s.seq().max_seq {
        return crate::generate::decode_one_by_one(s, first, max, sampler, on);
    }
    if greedy {
        if s.seq().meta_current != Some(first) {
            s.write_meta(first, start)?;
        }
        if max > 1 && s.runs_generations() {
            return stream_generation(s, start, max, stop, false, sampler, on);
        }
    } else {
        check_sampler_context(sampler, first, start)?;
        start_sampled_chain(s, sampler, first)?;
        if max > 1 && s.runs_generations() && s.samples_in_launch() {
            let r = stream_generation(s, start, max, stop, true, sampler, on);
            s.seq().history_synced = true;
            return r;
        }
    }
    let copy = s.gpu().copy_stream.clone();
    let vocab = s.vocab();
    let mut done = std::collections::VecDeque::with_capacity(STREAM_AHEAD + 1);
    let (mut launched, mut handled, mut last) = (0, 0, first);
    let result = loop {
        while launched < max && launched < handled + STREAM_AHEAD {
            if greedy {
                s.launch_step()?;
            } else {
                s.launch_sampled_step()?;
            }
            done.push_back(s.gpu().stream.record_event(None)?);
            launched += 1;
        }
        let Some(step) = done.pop_front() else {
            break Ok(());
        };
        // history[p + 1] is written once, by the step at p: once that step's event has fired,
        // the copy stream may read it while the compute stream runs the steps after.
        copy.wait(&step)?;
        let at = start + handled + 1;
        let t = copy.clone_dtoh(&s.history().slice(at..at + 1))?[0];
        handled += 1;
        if t >= vocab {
            s.check()?;
            break Err(out_of_vocabulary(
                if greedy { "argmax" } else { "sampler" },
                t,
            ));
        }
        last = t;
        match on(t) {
            Ok(true) if handled < max => sampler.accept(&[t]),
            Ok(_) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    let seq = s.seq();
    seq.pos = start + handled;
    // The device meta holds the last launched step's output: the next token to feed only if
    // nothing was launched past the last one handled.
    seq.meta_current = (launched == handled).then_some(last);
    if !greedy {
        seq.history_synced = true;
    }
    s.check()?;
    result
}

/// decode_stream's greedy (or, with `sampled`, in-launch sampled) steps as generations inside
/// launches (see `generate_in_launch`): the host takes each token as the device publishes it,
/// with nothing to launch per token.
fn stream_generation<S: Steps>(
    s: &mut S,
    start: usize,
    max: usize,
    stop: &[u32],
    sampled: bool,
    sampler: &mut Sampler,
    on: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    // The device checks at most MAX_STOP_TOKENS; past that the host alone stops.
    let stop = if stop.len() <= super::megakernel::MAX_STOP_TOKENS {
        stop
    } else {
        &[]
    };
    let mut handled = 0;
    let mut failure = None;
    let run = s.generate_in_launch(max, stop, sampled, &mut |t| {
        handled += 1;
        match on(t) {
            Ok(true) if handled < max => {
                sampler.accept(&[t]);
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(e) => {
                failure = Some(e);
                Ok(false)
            }
        }
    })?;
    end_generation(s, start, &run);
    s.check()?;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl<S: Steps> Backend for S {
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        feed(self, tokens)
    }

    fn rewind(&mut self, len: usize) -> Result<()> {
        self.seq().rewind(len)
    }

    fn feed_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(decode_greedy(self, token, 1)?[0])
    }

    fn feed_sampled(&mut self, token: u32, sampler: &Sampler) -> Result<u32> {
        Ok(decode_sampled(self, sampler, token, 1)?[0])
    }

    fn decode_stream(
        &mut self,
        first: u32,
        max: usize,
        stop: &[u32],
        sampler: &mut Sampler,
        on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        decode_stream(self, first, max, stop, sampler, on)
    }
}

#[cfg(test)]
mod tests {
    use super::out_of_vocabulary;

    #[test]
    fn a_device_token_outside_the_vocabulary_names_its_chooser() {
        assert_eq!(
            out_of_vocabulary("sampler", 49152).to_string(),
            "GPU sampler produced token 49152 outside the vocabulary (NaN logits?)"
        );
    }
}
