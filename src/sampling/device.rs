//! The sampler on the GPU, run after each decode step by the graph paths and the megakernel:
//! kernels/sampling/ compiled on its own, its parameters in a device buffer (so a captured
//! graph serves any parameters), and its per-block results. One kernel (`smp_sample`) draws;
//! the two-kernel sampler stays selectable ([`Kernels`]) for comparison and for
//! vocabularies too large for the fused kernel's last CTA.

use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::{CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;

use super::SamplingParams;
use crate::gpu::compile::compile_cubin;
use crate::gpu::device::{ptr, Gpu};
use crate::gpu::launch::Kernel;
use crate::kargs;

/// The sampling rule's device functions, which the megakernel's draw shares.
pub(crate) const PHILOX: &str = include_str!("../../kernels/sampling/philox.cuh");
pub(crate) const SELECT: &str = include_str!("../../kernels/sampling/select.cuh");
const SAMPLE: &str = include_str!("../../kernels/sampling/sample.cu");
const FUSED: &str = include_str!("../../kernels/sampling/fused.cu");

/// Logits per CTA of `smp_blocks`, and of `smp_sample` for the vocabularies too large for a
/// smaller chunk (`chunk_for_vocab`; [`DeviceSampler::with_chunk`] sets any), and the CTAs'
/// sizes (as in sample.cu and fused.cu).
const CHUNK: usize = 4096;
const BLOCK_THREADS: u32 = 512;
const FINAL_THREADS: u32 = 1024;
const SAMPLE_THREADS: u32 = 512;
/// `smp_sample`'s key slots per CTA (`SMP1_CAP`), and how many its last CTA can hold
/// (`SMP1_THREADS * SMP1_FINAL_PER`).
const SAMPLE_CAP: usize = 160;
const SAMPLE_SLOTS: usize = SAMPLE_THREADS as usize * 24;
/// Where the kernel before a draw left the largest logit: `blocks` 64-bit words, two apart
/// from `words`, each a block's maximum (f32 bits in the low half; the megakernel's LM-head
/// blocks, `lm_best`), all written before the draw starts.
#[derive(Clone, Copy, Debug)]
pub struct LmMaxima {
    pub words: u64,
    pub blocks: usize,
}

/// `smp_sample`'s gate words before its CTAs' maxima (`SMP1_GATE_MAXIMA` in fused.cu).
const GATE_WORDS: usize = 8;
/// Its words per CTA after those: a tagged maximum.
const GATE_WORDS_PER_BLOCK: usize = 2;

/// Where the fast attempt first looks: keys within 4 of the vocabulary's maximum logit (each
/// draw then leaves the distance it needed, with room, for the next).
const INITIAL_HINT: f32 = 4.0;
/// `SmpBlock` is 32 bytes.
const BLOCK_WORDS: usize = 4;

/// Whether the fused sampler's last CTA can hold the keys of every block of `chunk` logits
/// of a `vocab`-token vocabulary (SAMPLE_CAP slots a block, SAMPLE_SLOTS in all).
fn last_cta_holds(vocab: usize, chunk: usize) -> bool {
    vocab.div_ceil(chunk) * SAMPLE_CAP <= SAMPLE_SLOTS
}

/// Logits per CTA of the fused sampler for `vocab`: the smallest of 1024 and 2048 at which its
/// last CTA can hold every block's keys (vocabularies up to 76 x 1024 = 77,824 tokens, e.g.
/// SmolLM2's 49,152, at 1024; up to 155,648, e.g. Llama 3's 128,256 and Qwen's 151,936, at
/// 2048), else CHUNK. Fewer logits a CTA shorten its part before the last CTA's merge, whose
/// binned way costs about the same for more CTAs: on the H200 after a Llama-1B decode step
/// (BENCHMARKS.md, 2026-11-28), 2048 drew a sampled megakernel step about 1 µs faster than
/// 4096; on the H100 (2026-11-26) SmolLM2's vocabulary drew about 2 µs faster at 1024 than at
/// 4096.
pub fn chunk_for_vocab(vocab: usize) -> usize {
    [1024, 2048]
        .into_iter()
        .find(|&c| last_cta_holds(vocab, c))
        .unwrap_or(CHUNK)
}

/// The sampler's compilation unit.
pub fn source() -> String {
    [PHILOX, SELECT, SAMPLE, FUSED].join("\n")
}

/// The kernels and chunk [`DeviceSampler::new`] takes for `vocab`: the kernels
/// [`Kernels::for_vocab`] picks, the fused one at [`chunk_for_vocab`]'s chunk or
/// `MEGAINFER_SAMPLER_CHUNK`'s (1024, 2048 or 4096, for comparing chunks after a decode step).
pub fn kernels_and_chunk(vocab: usize) -> Result<(Kernels, usize)> {
    let kernels = Kernels::for_vocab(vocab);
    if kernels != Kernels::Fused {
        return Ok((kernels, CHUNK));
    }
    match crate::gpu::switches::count("MEGAINFER_SAMPLER_CHUNK")? {
        Some(chunk) => {
            check_chunk(vocab, kernels, chunk).context("MEGAINFER_SAMPLER_CHUNK")?;
            Ok((kernels, chunk))
        }
        None => Ok((kernels, chunk_for_vocab(vocab))),
    }
}

/// Whether `kernels` can draw from `vocab` logits in CTAs of `chunk`.
fn check_chunk(vocab: usize, kernels: Kernels, chunk: usize) -> Result<()> {
    anyhow::ensure!(
        [1024, 2048, CHUNK].contains(&chunk),
        "sampler chunk {chunk}: 1024, 2048 or 4096 logits per CTA"
    );
    anyhow::ensure!(
        kernels == Kernels::TwoPass || last_cta_holds(vocab, chunk),
        "the fused sampler holds at most {SAMPLE_SLOTS} keys: a vocabulary of {vocab} in \
         chunks of {chunk} needs more"
    );
    Ok(())
}

/// The sampler's CUBIN at `chunk` logits a CTA for `arch` (from the kernel cache where it was
/// compiled before). MEGAINFER_SAMPLER_DEFINES: compile options added for measuring variants
/// of the kernels, as MEGAINFER_MK_DEFINES for the megakernel; separated by spaces or commas
/// (one word in gpu-check.sh's NAME=VALUE lists).
pub fn compile_module(chunk: usize, arch: &str) -> Result<Vec<u8>> {
    let mut defines = vec![format!("-DSMP_CHUNK={chunk}")];
    if let Ok(extra) = std::env::var("MEGAINFER_SAMPLER_DEFINES") {
        defines.extend(
            extra
                .split(|c: char| c.is_whitespace() || c == ',')
                .filter(|w| !w.is_empty())
                .map(String::from),
        );
    }
    compile_cubin("sampling", &source(), arch, &defines)
}

/// Which kernels draw the token. Both apply the same rule to the same sums, so they draw the
/// same token from the same inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// `smp_sample`: one kernel; its last CTA to finish draws.
    Fused,
    /// `smp_blocks` then `smp_final`: a per-block kernel and a one-CTA kernel that draws.
    TwoPass,
}

impl Kernels {
    /// The kernels a vocabulary gets: the fused kernel unless its last CTA cannot hold every
    /// block's keys (vocabularies above 311,296 tokens).
    pub fn for_vocab(vocab: usize) -> Self {
        if last_cta_holds(vocab, CHUNK) {
            Kernels::Fused
        } else {
            Kernels::TwoPass
        }
    }
}

/// `SmpParams` as the kernels read it.
pub fn param_words(p: &SamplingParams) -> [u32; 8] {
    let last_n = if p.penalises() {
        p.repeat_last_n.min(u32::MAX as usize) as u32
    } else {
        0
    };
    [
        p.temperature.to_bits(),
        p.top_p.to_bits(),
        p.min_p.to_bits(),
        p.repeat_penalty.to_bits(),
        p.top_k as u32,
        last_n,
        p.seed as u32,
        (p.seed >> 32) as u32,
    ]
}

pub struct DeviceSampler {
    kernels: Kernels,
    philox_k: Kernel,
    blocks_k: Kernel,
    final_k: Kernel,
    sample_k: Kernel,
    _module: Arc<CudaModule>,
    params: CudaSlice<u32>,
    current: Option<SamplingParams>,
    blocks: CudaSlice<u64>,
    cand_v: CudaSlice<f32>,
    cand_i: CudaSlice<u32>,
    /// `smp_sample`'s key slots and its arrival counter.
    keys: CudaSlice<u64>,
    done: CudaSlice<u32>,
    /// `smp_sample`'s fast attempt (fused.cu): the logit distance below the maximum it looks
    /// within, left by the previous draw; its gate ([`GATE_WORDS`] words and
    /// [`GATE_WORDS_PER_BLOCK`] a block: the attempts' count, arrival counter and verdict, how
    /// many draws fell back to the searches and merged the long way, and each CTA's maximum);
    /// and whether it is made at all (0 no, 1 yes, 2 made to fail:
    /// [`Self::force_searches`]).
    hint: CudaSlice<f32>,
    gate: CudaSlice<u32>,
    fast: i32,
    vocab: usize,
    n_blocks: usize,
}

impl DeviceSampler {
    /// The sampler a path draws with: the kernels [`Kernels::for_vocab`] picks, the fused one
    /// at [`chunk_for_vocab`]'s chunk; `MEGAINFER_SAMPLER_CHUNK` (1024, 2048 or 4096) sets the
    /// chunk instead, for comparing chunks after a decode step.
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<Self> {
        let (kernels, chunk) = kernels_and_chunk(vocab)?;
        Self::with_chunk(gpu, vocab, kernels, chunk)
    }

    /// A sampler drawing with the given kernels (`Fused` only where [`Kernels::for_vocab`]
    /// would choose it).
    pub fn with_kernels(gpu: &Gpu, vocab: usize, kernels: Kernels) -> Result<Self> {
        Self::with_chunk(gpu, vocab, kernels, CHUNK)
    }

    /// A sampler whose CTAs take `chunk` logits each (1024, 2048 or 4096). Smaller chunks
    /// spread a vocabulary over more SMs but give the last CTA more keys to merge; which pays
    /// after a decode step depends on the vocabulary (`chunk_for_vocab`, BENCHMARKS.md).
    pub fn with_chunk(gpu: &Gpu, vocab: usize, kernels: Kernels, chunk: usize) -> Result<Self> {
        check_chunk(vocab, kernels, chunk)?;
        let n_blocks = vocab.div_ceil(chunk);
        let cubin = compile_module(chunk, &gpu.arch())?;
        let module = gpu
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .context("loading the sampling CUBIN")?;
        let fused = kernels == Kernels::Fused;
        // The fast attempt's CTAs wait for the last one's verdict, so all of them must be
        // resident at once: one CTA an SM (its 512 threads' registers), no more CTAs than SMs.
        // MEGAINFER_SAMPLER_FAST=0 turns it off (for comparisons).
        let fast = fused
            && n_blocks <= gpu.sm_count
            && crate::gpu::switches::switch("MEGAINFER_SAMPLER_FAST", true)?;
        let (cand_len, key_len) = if fused {
            (1, n_blocks * SAMPLE_CAP)
        } else {
            (n_blocks * super::K_MAX, 1)
        };
        Ok(Self {
            kernels,
            philox_k: Kernel::load(&module, "smp_philox_words")?,
            blocks_k: Kernel::load(&module, "smp_blocks")?,
            final_k: Kernel::load(&module, "smp_final")?,
            sample_k: Kernel::load(&module, "smp_sample")?,
            _module: module,
            params: gpu.alloc_zeros(8, "sampling parameters")?,
            current: None,
            blocks: gpu.alloc_zeros(n_blocks * BLOCK_WORDS, "sampling block results")?,
            cand_v: gpu.alloc_zeros(cand_len, "sampling candidate logits")?,
            cand_i: gpu.alloc_zeros(cand_len, "sampling candidate tokens")?,
            keys: gpu.alloc_zeros(key_len, "sampling candidate keys")?,
            done: gpu.alloc_zeros(1, "sampling arrival counter")?,
            hint: gpu.upload(&[INITIAL_HINT], "sampling hint")?,
            gate: gpu.alloc_zeros(
                GATE_WORDS + GATE_WORDS_PER_BLOCK * n_blocks,
                "sampling gate",
            )?,
            fast: fast as i32,
            vocab,
            n_blocks,
        })
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Whether truncating draws first try without the blocks' threshold searches.
    pub fn fast(&self) -> bool {
        self.fast != 0
    }

    /// For tests: every truncating draw's first attempt made to fail (as if the hint were 0),
    /// so that each one takes the searches after it.
    pub fn force_searches(&mut self, on: bool) {
        if self.fast != 0 {
            self.fast = if on { 2 } else { 1 };
        }
    }

    /// How many draws so far tried without the searches and then needed them.
    pub fn fallbacks(&self, gpu: &Gpu) -> Result<u32> {
        Ok(gpu.stream.clone_dtoh(&self.gate)?[2])
    }

    /// How many first attempts' merges so far took the long way (the threshold search over
    /// the union) instead of the binned one (`smp_merge_binned_counted` in select.cuh).
    pub fn long_merges(&self, gpu: &Gpu) -> Result<u32> {
        Ok(gpu.stream.clone_dtoh(&self.gate)?[3])
    }

    /// Philox4x32-10 of each counter under `key`, computed on the device (for tests).
    pub fn philox_on_device(
        &self,
        gpu: &Gpu,
        counters: &[[u32; 4]],
        key: [u32; 2],
    ) -> Result<Vec<[u32; 4]>> {
        let flat: Vec<u32> = counters.iter().flatten().copied().collect();
        let ctr = gpu.upload(&flat, "philox counters")?;
        let out = gpu.alloc_zeros::<u32>(flat.len(), "philox outputs")?;
        let s = &gpu.stream;
        let (cp, op, n) = (ptr(&ctr, s), ptr(&out, s), counters.len() as i32);
        let grid = (counters.len() as u32).div_ceil(256);
        // SAFETY: (counters ptr, key0, key1, outputs ptr, n) as sample.cu's philox kernel
        // declares them; both buffers hold 4·n words and live until the copy below.
        unsafe {
            self.philox_k.launch(
                s,
                grid,
                256,
                0,
                false,
                &mut kargs![&cp, &key[0], &key[1], &op, &n],
            )
        }?;
        let words = s.clone_dtoh(&out)?;
        Ok(words
            .chunks_exact(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect())
    }

    /// The sampler a path keeps in `slot`, made on first use, with `p` the parameters of the
    /// steps enqueued next.
    pub fn prepared<'a>(
        slot: &'a mut Option<Self>,
        gpu: &Gpu,
        vocab: usize,
        p: &SamplingParams,
    ) -> Result<&'a Self> {
        if slot.is_none() {
            *slot = Some(Self::new(gpu, vocab)?);
        }
        let sampler = slot.as_mut().expect("made above");
        sampler.set_params(&gpu.stream, p)?;
        Ok(sampler)
    }

    /// Makes `p` the parameters of the steps enqueued after this call (stream-ordered).
    pub fn set_params(&mut self, stream: &Arc<CudaStream>, p: &SamplingParams) -> Result<()> {
        if self.current.as_ref() != Some(p) {
            stream.memcpy_htod(&param_words(p), &mut self.params)?;
            self.current = Some(*p);
        }
        Ok(())
    }

    /// Enqueues the draw from `logits` (f32 [vocab]) for the step described by the
    /// TokenMeta at `meta`: the token goes to the TokenMeta at `meta_out` (which may be `meta`)
    /// and to `history[pos + 1]`. `maxima`: where the kernel before it also left the logits'
    /// maximum; the fused sampler's first attempt then cuts below it at once instead of sharing
    /// its CTAs' maxima first (without a repetition penalty, which lowers logits).
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        logits: u64,
        meta: u64,
        meta_out: u64,
        history: u64,
        pdl: bool,
        maxima: Option<LmMaxima>,
    ) -> Result<()> {
        let (params, blocks, cand_v, cand_i) = (
            ptr(&self.params, stream),
            ptr(&self.blocks, stream),
            ptr(&self.cand_v, stream),
            ptr(&self.cand_i, stream),
        );
        let (vocab, nb) = (self.vocab as i32, self.n_blocks as i32);
        if self.kernels == Kernels::Fused {
            let (keys, done) = (ptr(&self.keys, stream), ptr(&self.done, stream));
            let (hint, gate, fast) = (ptr(&self.hint, stream), ptr(&self.gate, stream), self.fast);
            let (lm_max, n_lm_max) = match maxima {
                Some(m) if m.blocks > 0 && m.blocks <= SAMPLE_THREADS as usize => {
                    (m.words, m.blocks as i32)
                }
                _ => (0u64, 0i32),
            };
            // SAFETY: the arguments match smp_sample's parameters in fused.cu, in order; params,
            // blocks, keys (SMP1_CAP per block), done (zero between launches: the kernel's
            // last CTA resets it), hint (one float) and gate (GATE_WORDS + GATE_WORDS_PER_BLOCK * n_blocks words,
            // its arrival counter zero between launches) are this sampler's buffers, sized for
            // `vocab` at construction, and logits, meta, meta_out and history are the caller's
            // live buffers of the same vocabulary; lm_max is null or the caller's 2 * n_lm_max
            // words (LmMaxima), n_lm_max at most the CTA's threads. `fast` is set only where
            // every CTA fits on the GPU at once (one an SM, no more than its SMs), which its
            // waiting CTAs need.
            return unsafe {
                self.sample_k.launch(
                    stream,
                    self.n_blocks as u32,
                    SAMPLE_THREADS,
                    0,
                    pdl,
                    &mut kargs![
                        &logits, &vocab, &meta, &history, &params, &blocks, &keys, &done,
                        &meta_out, &hint, &gate, &fast, &lm_max, &n_lm_max
                    ],
                )
            };
        }
        // SAFETY: the arguments match smp_blocks' and smp_final's parameters in sample.cu, in
        // order; params, blocks and candidates are this sampler's buffers (sized for `vocab`
        // and `n_blocks` at construction), and logits, meta, meta_out and history are the caller's live
        // buffers of the same vocabulary.
        unsafe {
            self.blocks_k.launch(
                stream,
                self.n_blocks as u32,
                BLOCK_THREADS,
                0,
                pdl,
                &mut kargs![&logits, &vocab, &meta, &history, &params, &blocks, &cand_v, &cand_i],
            )?;
            self.final_k.launch(
                stream,
                1,
                FINAL_THREADS,
                0,
                pdl,
                &mut kargs![&blocks, &nb, &cand_v, &cand_i, &params, &meta, &history, &meta_out],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_kernel_covers_the_vocabularies_its_last_cta_can_hold() {
        for vocab in [1, 1000, 49_152, 128_256, 151_936, 262_144, 311_296] {
            assert_eq!(Kernels::for_vocab(vocab), Kernels::Fused, "{vocab}");
        }
        assert_eq!(Kernels::for_vocab(311_297), Kernels::TwoPass);
    }

    /// 1024 logits per CTA wherever the last CTA can hold the blocks' keys, else 2048 where it
    /// can, else 4096.
    #[test]
    fn small_vocabularies_take_the_small_chunk() {
        for (vocab, chunk) in [
            (1, 1024),
            (49_152, 1024),
            (77_824, 1024),
            (77_825, 2048),
            (128_256, 2048),
            (151_936, 2048),
            (155_648, 2048),
            (155_649, 4096),
            (262_144, 4096),
        ] {
            assert_eq!(chunk_for_vocab(vocab), chunk, "{vocab}");
            assert!(
                vocab.div_ceil(chunk) * SAMPLE_CAP <= SAMPLE_SLOTS,
                "{vocab}"
            );
        }
    }

    /// The sizes the host assumes are fused.cu's.
    #[test]
    fn fused_kernel_sizes_match_the_source() {
        let per = SAMPLE_SLOTS / SAMPLE_THREADS as usize;
        for define in [
            format!("#define SMP1_THREADS {SAMPLE_THREADS}\n"),
            format!("#define SMP1_CAP {SAMPLE_CAP} "),
            format!("#define SMP1_FINAL_PER {per} "),
            format!("#define SMP_CHUNK {CHUNK}\n"),
            "#ifndef SMP_CHUNK\n".to_string(),
        ] {
            assert!(
                source().contains(&define),
                "{define:?} missing from the sampler's source"
            );
        }
    }
}
