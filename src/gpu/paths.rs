//! The GPU decode paths behind one type, for `run` and `bench`.

use anyhow::{bail, Context, Result};

use super::baseline::{BaselinePath, Mode};
use super::device::Gpu;
use super::megakernel::MegakernelPath;
use super::model::DeviceModel;
use crate::generate::Backend;
use crate::sampling::Sampler;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    Megakernel,
    GraphPdl,
    Graph,
    Eager,
}

impl PathKind {
    pub const ALL: [PathKind; 4] = [
        PathKind::Megakernel,
        PathKind::GraphPdl,
        PathKind::Graph,
        PathKind::Eager,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PathKind::Megakernel => "megakernel",
            PathKind::GraphPdl => "graph-pdl",
            PathKind::Graph => "graph",
            PathKind::Eager => "eager",
        }
    }

    pub fn parse_list(s: &str) -> Result<Vec<PathKind>> {
        if s == "all" {
            return Ok(Self::ALL.to_vec());
        }
        s.split(',')
            .map(|name| match Self::ALL.iter().find(|p| p.name() == name.trim()) {
                Some(p) => Ok(*p),
                None => bail!("--paths: unknown path '{name}' (known: megakernel, graph-pdl, graph, eager, all)"),
            })
            .collect()
    }
}

/// The longest wait a user may set: ten minutes.
pub const MAX_WAIT_TIMEOUT_MS: u64 = 600_000;

pub enum GpuPath<'g> {
    Megakernel(Box<MegakernelPath<'g>>),
    Baseline(Box<BaselinePath<'g>>),
}

impl<'g> GpuPath<'g> {
    /// `max_seq` sizes the KV cache; `expected_len` is the length the sequence is expected to
    /// reach, which the graph paths choose their attention for (split-KV and its parts, sized
    /// for that length: a 40-token answer runs faster on a block per query head). The
    /// megakernel needs no guess: it keeps a schedule per context bucket up to `max_seq` and
    /// switches as the sequence grows.
    pub fn new(
        kind: PathKind,
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        max_seq: usize,
        expected_len: usize,
    ) -> Result<Self> {
        let mode = match kind {
            PathKind::Megakernel => {
                // One set of streams per context bucket up to max_seq: the split-KV parts
                // follow the sequence as it grows; the scheduler's choices as the environment
                // sets them, for measuring (env_overrides).
                let (overrides, set) = env_overrides()?;
                let path = MegakernelPath::bucketed(gpu, model, max_seq, &overrides);
                // The scheduler names the option it refuses; say which variable set it.
                let path = if set.is_empty() {
                    path
                } else {
                    path.with_context(|| {
                        format!("the megakernel's streams, with {} set", set.join(", "))
                    })
                };
                return Ok(Self::Megakernel(Box::new(path?)));
            }
            PathKind::GraphPdl => Mode::GraphPdl,
            PathKind::Graph => Mode::Graph,
            PathKind::Eager => Mode::Eager,
        };
        Ok(Self::Baseline(Box::new(BaselinePath::new_for(
            gpu,
            model,
            mode,
            max_seq,
            expected_len,
        )?)))
    }

    /// Makes the batched-prefill engine and captures its short-prompt graphs now (at load),
    /// so that the first prompt's time to first token is the prompt's own.
    pub fn prepare_prefill(&mut self) -> Result<()> {
        match self {
            Self::Megakernel(p) => super::stepping::prepare_prefill(p.as_mut()),
            Self::Baseline(p) => super::stepping::prepare_prefill(p.as_mut()),
        }
    }

    /// Readies the device sampler for `p` now (at load), so that the first sampled step does
    /// not compile it inside the timed decode. Nothing to do for greedy decoding.
    pub fn prepare_sampling(&mut self, p: &crate::sampling::SamplingParams) -> Result<()> {
        use super::stepping::Steps;
        if !p.is_greedy() {
            match self {
                Self::Megakernel(m) => m.prepare_sampling(p)?,
                Self::Baseline(b) => b.prepare_sampling(p)?,
            };
        }
        Ok(())
    }

    pub fn as_megakernel(&mut self) -> Option<&mut MegakernelPath<'g>> {
        match self {
            Self::Megakernel(p) => Some(p),
            Self::Baseline(_) => None,
        }
    }

    /// How long the megakernel waits for an input before it stops with an error naming it
    /// (the baseline paths have no such waits). At most [`MAX_WAIT_TIMEOUT_MS`].
    pub fn set_wait_timeout_ms(&mut self, ms: u64) -> Result<()> {
        if !(1..=MAX_WAIT_TIMEOUT_MS).contains(&ms) {
            anyhow::bail!("--wait-timeout-ms {ms}: must be between 1 and {MAX_WAIT_TIMEOUT_MS}");
        }
        if let Self::Megakernel(p) = self {
            p.set_wait_timeout_ms(ms);
        }
        Ok(())
    }

    /// Prompt tokens per batched-prefill chunk (at least 1; default
    /// [`super::prefill::DEFAULT_CHUNK`]): larger chunks make larger products, smaller ones
    /// bound the activations' memory.
    pub fn set_prefill_chunk(&mut self, tokens: usize) -> Result<()> {
        use super::stepping::Steps;
        if tokens == 0 {
            bail!("--prefill-chunk must be at least 1 token");
        }
        match self {
            Self::Megakernel(p) => p.seq().prefill_chunk = tokens,
            Self::Baseline(p) => p.seq().prefill_chunk = tokens,
        }
        Ok(())
    }

    /// The host's view of the last batched prefill, once (see [`Prefill::take_timing`]).
    ///
    /// [`Prefill::take_timing`]: super::prefill::Prefill::take_timing
    pub fn take_prefill_timing(&mut self) -> Option<super::prefill::PrefillTiming> {
        use super::stepping::Steps;
        let seq = match self {
            Self::Megakernel(p) => p.seq(),
            Self::Baseline(p) => p.seq(),
        };
        seq.prefill.as_mut().and_then(|p| p.take_timing())
    }

    pub fn reset(&mut self) {
        match self {
            Self::Megakernel(p) => p.reset(),
            Self::Baseline(p) => p.reset(),
        }
    }

    /// Greedy steps per launch on the megakernel (see
    /// [`MegakernelPath::set_tokens_per_launch`]); the graph paths launch per step anyway.
    pub fn set_tokens_per_launch(&mut self, n: usize) {
        if let Self::Megakernel(p) = self {
            p.set_tokens_per_launch(n);
        }
    }

    /// On the megakernel, sampled steps draw inside the launch (see
    /// [`MegakernelPath::set_draw_in_launch`]); the graph paths draw after each step anyway.
    pub fn set_draw_in_launch(&mut self, on: bool) -> Result<()> {
        match self {
            Self::Megakernel(p) => p.set_draw_in_launch(on),
            _ => Ok(()),
        }
    }

    pub fn decode_greedy(&mut self, token: u32, n: usize) -> Result<Vec<u32>> {
        match self {
            Self::Megakernel(p) => p.decode_greedy(token, n),
            Self::Baseline(p) => p.decode_greedy(token, n),
        }
    }

    /// `n` sampled steps from `token` (the last of `sampler`'s context); on the device where
    /// the path has a device sampler, else drawn on the host from copied logits.
    pub fn decode_sampled(&mut self, sampler: &Sampler, token: u32, n: usize) -> Result<Vec<u32>> {
        match self {
            Self::Megakernel(p) => super::stepping::decode_sampled(p.as_mut(), sampler, token, n),
            Self::Baseline(p) => p.decode_sampled(sampler, token, n),
        }
    }
}

impl Backend for GpuPath<'_> {
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self {
            Self::Megakernel(p) => p.feed(tokens),
            Self::Baseline(p) => p.feed(tokens),
        }
    }

    fn rewind(&mut self, len: usize) -> Result<()> {
        match self {
            Self::Megakernel(p) => p.rewind(len),
            Self::Baseline(p) => p.rewind(len),
        }
    }

    fn feed_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(self.decode_greedy(token, 1)?[0])
    }

    fn feed_sampled(&mut self, token: u32, sampler: &Sampler) -> Result<u32> {
        Ok(self.decode_sampled(sampler, token, 1)?[0])
    }

    fn decode_stream(
        &mut self,
        first: u32,
        max: usize,
        stop: &[u32],
        sampler: &mut Sampler,
        on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        match self {
            Self::Megakernel(p) => {
                super::stepping::decode_stream(p.as_mut(), first, max, stop, sampler, on)
            }
            Self::Baseline(p) => {
                super::stepping::decode_stream(p.as_mut(), first, max, stop, sampler, on)
            }
        }
    }
}

/// The megakernel scheduler's choices as the environment sets them, for measuring other
/// granularities (the path and `megainfer schedule` both read them), and the variables set:
/// MEGAINFER_MK_ATTN_PARTS (split-KV parts per KV head, in one bucket), MEGAINFER_MK_QKV_PAIRS
/// (RoPE pairs per RmsQkvRope), MEGAINFER_MK_QKV_PIECES (RmsQkvRope instructions a layer, heads
/// split evenly), MEGAINFER_MK_OPROJ_ROWS, _UPGATE_ROWS, _DOWN_ROWS, _DOWN_CHUNKS and
/// _LMHEAD_ROWS (rows per instruction and the down projection's k-chunks), and
/// MEGAINFER_MK_ATTN_HEADS (query heads per Attention instruction in the buckets of one part).
pub fn env_overrides() -> Result<(scheduler::Overrides, Vec<&'static str>)> {
    const VARS: [&str; 9] = [
        "MEGAINFER_MK_ATTN_PARTS",
        "MEGAINFER_MK_QKV_PAIRS",
        "MEGAINFER_MK_QKV_PIECES",
        "MEGAINFER_MK_OPROJ_ROWS",
        "MEGAINFER_MK_UPGATE_ROWS",
        "MEGAINFER_MK_DOWN_ROWS",
        "MEGAINFER_MK_DOWN_CHUNKS",
        "MEGAINFER_MK_LMHEAD_ROWS",
        "MEGAINFER_MK_ATTN_HEADS",
    ];
    let [attn_parts, qkv_pairs, qkv_pieces, oproj_rows, upgate_rows, down_rows, down_chunks, lmhead_rows, attn_heads] =
        VARS.map(super::switches::count);
    let overrides = scheduler::Overrides {
        attn_parts: attn_parts?,
        qkv_pairs: qkv_pairs?,
        qkv_pieces: qkv_pieces?,
        oproj_rows: oproj_rows?,
        upgate_rows: upgate_rows?,
        down_rows: down_rows?,
        down_chunks: down_chunks?,
        lmhead_rows: lmhead_rows?,
        attn_heads: attn_heads?,
    };
    let set = VARS
        .into_iter()
        .filter(|v| std::env::var_os(v).is_some())
        .collect();
    Ok((overrides, set))
}
