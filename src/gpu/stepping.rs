//! What every GPU decode path shares: the sequence position, feeding a prompt (batched
//! prefill, or one step per token), and greedy decoding back to back with the chosen tokens
//! left on the device.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;

use super::device::Gpu;
use super::model::DeviceModel;
use super::prefill::{KvTarget, Logits, Prefill, DEFAULT_CHUNK};
use crate::generate::Backend;

/// Position bookkeeping of one sequence.
pub struct Sequence {
    /// Tokens already in the KV cache: the position of the next one.
    pub pos: usize,
    pub max_seq: usize,
    /// Set when the device's token meta already holds (this token, `pos`), as the argmax of
    /// the last greedy step left it: then the host writes nothing before the next step.
    pub meta_current: Option<u32>,
    /// The batched-prefill engine, made for the first prompt that uses it.
    pub prefill: Option<Prefill>,
    /// Tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Feeds of at least this many tokens go through batched prefill; shorter ones (a
    /// sampled token) are decode steps. `usize::MAX` feeds every prompt one step per token.
    pub prefill_min: usize,
}

impl Sequence {
    pub fn new(max_seq: usize) -> Self {
        Self {
            pos: 0,
            max_seq,
            meta_current: None,
            prefill: None,
            prefill_chunk: DEFAULT_CHUNK,
            prefill_min: 2,
        }
    }

    /// Starts a new sequence (the KV cache is simply overwritten).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.meta_current = None;
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
    /// The weights the steps read.
    fn model(&self) -> &DeviceModel;
    /// The path's KV cache and its layout, which prefill writes into.
    fn kv_target(&self) -> KvTarget;
}

/// Feeds `tokens`, as batched prefill when there are at least `prefill_min` of them, else one
/// step each; the f32 logits after the last.
pub fn feed<S: Steps>(s: &mut S, tokens: &[u32]) -> Result<Vec<f32>> {
    if tokens.len() >= s.seq().prefill_min {
        prefill(s, tokens, Logits::Last)
    } else {
        feed_steps(s, tokens)
    }
}

/// Feeds `tokens` through batched prefill at the next positions, in chunks of
/// `seq().prefill_chunk` tokens; K/V land in the path's cache, and the next decode step
/// continues from there (its meta is written afresh).
pub fn prefill<S: Steps>(s: &mut S, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
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
    s.seq().check_room(tokens.len())?;
    for &t in tokens {
        let pos = s.seq().pos;
        s.write_meta(t, pos)?;
        s.launch_step()?;
        s.seq().pos += 1;
    }
    s.seq().meta_current = None;
    s.check()?;
    Ok(s.gpu().stream.clone_dtoh(s.logits())?)
}

/// `n` greedy steps from `token` launched back to back: each step's argmax feeds the next on
/// the device, and the host reads the tokens once at the end.
pub fn decode_greedy<S: Steps>(s: &mut S, token: u32, n: usize) -> Result<Vec<u32>> {
    s.seq().check_room(n)?;
    let start = s.seq().pos;
    if s.seq().meta_current != Some(token) {
        s.write_meta(token, start)?;
    }
    for _ in 0..n {
        s.launch_step()?;
    }
    s.seq().pos += n;
    s.check()?;
    // Only the n new tokens (the whole history is max_seq words).
    let out = s
        .gpu()
        .stream
        .clone_dtoh(&s.history().slice(start + 1..start + 1 + n))?;
    let vocab = s.vocab();
    if let Some(bad) = out.iter().find(|&&t| t >= vocab) {
        bail!("GPU argmax produced token {bad} outside the vocabulary (NaN logits?)");
    }
    s.seq().meta_current = out.last().copied();
    Ok(out)
}

impl<S: Steps> Backend for S {
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        feed(self, tokens)
    }

    fn feed_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(decode_greedy(self, token, 1)?[0])
    }
}
