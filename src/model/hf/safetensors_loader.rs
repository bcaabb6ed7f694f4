//! Weights from `model.safetensors` or a sharded `model.safetensors.index.json`: memory-mapped,
//! checked tensor by tensor against the config, converted to bf16.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde_json::Value;

use crate::model::{Config, LayerWeights, Matrix, QkvBias, Weights};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
/// The safetensors crate refuses larger headers; the diagnosis follows the same bound.
const MAX_HEADER_BYTES: usize = 100_000_000;
/// Enough problems to see a pattern (e.g. one whole layer missing) without flooding the terminal.
const MAX_PROBLEMS_SHOWN: usize = 12;

/// Up to this many expected tensors for a file holding `present`, the per-tensor check runs
/// and names exactly what is missing; beyond it the claim is refused outright, so a header's
/// claim never costs more than a small multiple of the tensors the file really has.
fn plausible_tensor_count(present: usize) -> usize {
    present.saturating_mul(2).saturating_add(32)
}

/// Tensors every layer of a `LlamaForCausalLM` has.
const TENSORS_PER_LAYER: usize = 9;

pub(super) fn load_weights(dir: &Path, cfg: &Config) -> Result<Weights> {
    let ckpt = Checkpoint::open(dir)?;
    ckpt.check_layer_count(cfg, &dir.join("config.json"))?;
    ckpt.check(cfg)?;
    let total: usize = expected_tensors(cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let bar = progress_bar(2 * total as u64);
    let read = |name: &str| {
        let t = ckpt.read(name)?;
        bar.inc(2 * t.len() as u64);
        Ok::<_, anyhow::Error>(t)
    };
    let layer = |i: usize, name: &str| read(&format!("model.layers.{i}.{name}.weight"));
    let (h, f, q) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim());
    let matrix = |i: usize, name: &str, cols: usize| {
        Ok::<_, anyhow::Error>(Matrix::from_bf16(layer(i, name)?, cols))
    };
    let layers = (0..cfg.num_layers)
        .map(|i| {
            Ok(LayerWeights {
                attn_norm: layer(i, "input_layernorm")?,
                wq: matrix(i, "self_attn.q_proj", h)?,
                wk: matrix(i, "self_attn.k_proj", h)?,
                wv: matrix(i, "self_attn.v_proj", h)?,
                wo: matrix(i, "self_attn.o_proj", q)?,
                ffn_norm: layer(i, "post_attention_layernorm")?,
                w_gate: matrix(i, "mlp.gate_proj", h)?,
                w_up: matrix(i, "mlp.up_proj", h)?,
                w_down: matrix(i, "mlp.down_proj", f)?,
                q_norm: cfg
                    .qk_norm
                    .then(|| layer(i, "self_attn.q_norm"))
                    .transpose()?,
                k_norm: cfg
                    .qk_norm
                    .then(|| layer(i, "self_attn.k_norm"))
                    .transpose()?,
                qkv_bias: cfg
                    .qkv_bias
                    .then(|| {
                        let bias = |p: &str| read(&format!("model.layers.{i}.self_attn.{p}.bias"));
                        Ok::<_, anyhow::Error>(QkvBias {
                            q: bias("q_proj")?,
                            k: bias("k_proj")?,
                            v: bias("v_proj")?,
                        })
                    })
                    .transpose()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = Weights {
        embed: Matrix::from_bf16(read("model.embed_tokens.weight")?, h),
        layers,
        final_norm: read("model.norm.weight")?,
        lm_head: if cfg.tie_word_embeddings {
            None
        } else {
            Some(Matrix::from_bf16(read("lm_head.weight")?, h))
        },
    };
    bar.finish_and_clear();
    Ok(weights)
}

/// Shown only on a terminal, so logs and tests stay clean.
fn progress_bar(total_bytes: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total_bytes).with_message("loading weights");
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} ({elapsed})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Every tensor a model of this architecture and config has, with its `[out, in]` shape.
fn expected_tensors(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv, ff) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        out.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![ff, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![ff, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, ff]),
        ]);
        if cfg.qk_norm {
            out.push((format!("{p}.self_attn.q_norm.weight"), vec![cfg.head_dim]));
            out.push((format!("{p}.self_attn.k_norm.weight"), vec![cfg.head_dim]));
        }
        if cfg.qkv_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Tensors that may be present but carry nothing we use.
fn ignorable(name: &str, cfg: &Config) -> bool {
    // Old checkpoints saved RoPE's inv_freq buffer; we derive it from the config. A tied model
    // that still ships lm_head.weight is tied in HF too: the embedding wins.
    name.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name == "lm_head.weight")
}

/// Counts every problem but keeps only the first few, so a hostile checkpoint cannot make the
/// list itself large.
#[derive(Default)]
struct Problems {
    total: usize,
    shown: Vec<String>,
}

impl Problems {
    fn push(&mut self, p: String) {
        self.total += 1;
        if self.shown.len() < MAX_PROBLEMS_SHOWN {
            self.shown.push(p);
        }
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// Where one tensor's bytes lie.
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the shard's mapping, header included.
    start: usize,
    end: usize,
}

struct Checkpoint {
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
    /// The file that says which tensors exist: blamed for missing ones.
    listing: PathBuf,
}

impl Checkpoint {
    fn open(dir: &Path) -> Result<Self> {
        // HF prefers the single file when both exist.
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            let (map, entries) = open_shard(&single)?;
            let tensors = entries.into_iter().collect();
            Ok(Self {
                shards: vec![Shard {
                    path: single.clone(),
                    map,
                }],
                tensors,
                listing: single,
            })
        } else if index.is_file() {
            Self::open_sharded(dir, index)
        } else {
            bail!(
                "{}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)",
                dir.display()
            )
        }
    }

    fn open_sharded(dir: &Path, index: PathBuf) -> Result<Self> {
        let shown = index.display();
        let text =
            std::fs::read_to_string(&index).with_context(|| format!("{shown}: cannot read"))?;
        let root: Value =
            serde_json::from_str(&text).with_context(|| format!("{shown}: not valid JSON"))?;
        let weight_map = root
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| anyhow!("{shown}: no weight_map object"))?;
        // Tensor name -> shard file name, and the shards in a stable order.
        let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, file) in weight_map {
            let file = file
                .as_str()
                .ok_or_else(|| anyhow!("{shown}: weight_map entry for {name} is not a string"))?;
            // A hostile index must not make us read files outside the model directory.
            if Path::new(file).file_name().is_none_or(|f| f != file) {
                bail!("{shown}: tensor {name} is mapped to {file:?}, which is not a plain file name in the model directory");
            }
            wanted.insert(name, file);
        }
        let files: BTreeSet<&str> = wanted.values().copied().collect();

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::with_capacity(wanted.len());
        for (shard, file) in files.into_iter().enumerate() {
            let path = dir.join(file);
            if !path.is_file() {
                let mut held = wanted.iter().filter(|(_, f)| **f == file).map(|(n, _)| *n);
                let first = held.next().unwrap_or_default();
                bail!(
                    "{shown}: shard {} does not exist (it should hold tensor {first} and {} more)",
                    path.display(),
                    held.count()
                );
            }
            let (map, entries) = open_shard(&path)?;
            for (name, e) in entries {
                if wanted.get(name.as_str()) != Some(&file) {
                    bail!(
                        "{}: tensor {name} is in this shard, but {shown} does not map it here",
                        path.display()
                    );
                }
                tensors.insert(name, Entry { shard, ..e });
            }
            shards.push(Shard { path, map });
        }
        if let Some((name, file)) = wanted.iter().find(|(n, _)| !tensors.contains_key(**n)) {
            bail!(
                "{}: tensor {name} is listed in {shown} but not in the file",
                dir.join(file).display()
            );
        }
        Ok(Self {
            shards,
            tensors,
            listing: index,
        })
    }

    /// The config's layer count against the tensors the checkpoint really holds, before any
    /// per-layer list is built: a config claiming millions of layers must cost nothing.
    fn check_layer_count(&self, cfg: &Config, config_path: &Path) -> Result<()> {
        let needed = cfg
            .num_layers
            .checked_mul(TENSORS_PER_LAYER)
            .and_then(|n| n.checked_add(2));
        match needed {
            Some(n) if n <= plausible_tensor_count(self.tensors.len()) => Ok(()),
            _ => bail!(
                "{}: num_hidden_layers is {}, which needs at least {} tensors, but {} holds only {} \
                 tensors",
                config_path.display(),
                cfg.num_layers,
                needed.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                self.listing.display(),
                self.tensors.len()
            ),
        }
    }

    /// Names, shapes and dtypes against the config, all problems at once (the first few kept).
    fn check(&self, cfg: &Config) -> Result<()> {
        let mut problems = Problems::default();
        let expected = expected_tensors(cfg);
        for (name, shape) in &expected {
            let Some(e) = self.tensors.get(name) else {
                problems.push(format!(
                    "{}: tensor {name} is missing",
                    self.listing.display()
                ));
                continue;
            };
            let file = self.shards[e.shard].path.display();
            if !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                problems.push(format!(
                    "{file}: tensor {name} has dtype {}, expected BF16, F16 or F32",
                    e.dtype
                ));
            }
            if &e.shape != shape {
                problems.push(format!(
                    "{file}: tensor {name} has shape {:?}, expected {shape:?}",
                    e.shape
                ));
            }
        }
        let known: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        let mut extra: Vec<(&String, &Entry)> = self
            .tensors
            .iter()
            .filter(|(n, _)| !known.contains(n.as_str()) && !ignorable(n, cfg))
            .collect();
        extra.sort_by_key(|(n, _)| *n);
        for (name, e) in extra {
            problems.push(format!(
                "{}: unexpected tensor {name} (not part of a {} with this config)",
                self.shards[e.shard].path.display(),
                cfg.architecture
            ));
        }
        if problems.total == 0 {
            return Ok(());
        }
        let (total, problems) = (problems.total, problems.shown);
        let plural = if total == 1 { "" } else { "s" };
        let mut msg = format!("weights do not match the config ({total} problem{plural}):");
        for p in &problems {
            msg.push_str("\n  ");
            msg.push_str(p);
        }
        if total > MAX_PROBLEMS_SHOWN {
            msg.push_str(&format!("\n  ... and {} more", total - MAX_PROBLEMS_SHOWN));
        }
        bail!(msg)
    }

    fn read(&self, name: &str) -> Result<Vec<bf16>> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.listing.display()))?;
        let bytes = &self.shards[e.shard].map[e.start..e.end];
        // Chunks of 64K elements amortise rayon's per-task cost; a norm vector is one task.
        const MIN: usize = 1 << 16;
        Ok(match e.dtype {
            Dtype::BF16 => bytes
                .par_chunks_exact(2)
                .with_min_len(MIN)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect(),
            Dtype::F16 => bytes
                .par_chunks_exact(2)
                .with_min_len(MIN)
                .map(|b| bf16::from_f32(f16::from_le_bytes([b[0], b[1]]).to_f32()))
                .collect(),
            Dtype::F32 => bytes
                .par_chunks_exact(4)
                .with_min_len(MIN)
                .map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            other => bail!(
                "{}: tensor {name} has dtype {other}, expected BF16, F16 or F32",
                self.shards[e.shard].path.display()
            ),
        })
    }
}

/// Maps one safetensors file and lists its tensors (shard index left at 0).
fn open_shard(path: &Path) -> Result<(Mmap, Vec<(String, Entry)>)> {
    let shown = path.display();
    let file = File::open(path).with_context(|| format!("{shown}: cannot open"))?;
    // SAFETY: the mapping is read-only and lives while we convert; like every mmap-based loader
    // we rely on nobody truncating or rewriting the weight files while the model loads.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{shown}: cannot map"))?;
    let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
        anyhow!(
            "{shown}: not a valid safetensors file: {}",
            explain(&map, e)
        )
    })?;
    // The crate checked that the offsets tile the data area exactly, so these ranges are in bounds.
    let base = 8 + header_len;
    let entries = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let entry = Entry {
                shard: 0,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: base + info.data_offsets.0,
                end: base + info.data_offsets.1,
            };
            (name, entry)
        })
        .collect();
    Ok((map, entries))
}

/// The safetensors crate's errors for a broken file do not say which tensor is at fault, nor
/// that the file looks truncated; re-reading the header leniently usually can.
fn explain(bytes: &[u8], err: SafeTensorError) -> String {
    match diagnose(bytes) {
        Some(why) => why,
        None => err.to_string(),
    }
}

fn diagnose(bytes: &[u8]) -> Option<String> {
    let Some(prefix) = bytes.get(..8) else {
        return Some(format!(
            "{} bytes is shorter than the 8-byte header length (truncated?)",
            bytes.len()
        ));
    };
    let n = usize::try_from(u64::from_le_bytes(prefix.try_into().ok()?)).ok()?;
    if n > MAX_HEADER_BYTES {
        return None;
    }
    let Some(header) = bytes.get(8..).and_then(|rest| rest.get(..n)) else {
        return Some(format!(
            "the header should be {n} bytes but only {} follow its length (truncated?)",
            bytes.len() - 8
        ));
    };
    let map: serde_json::Map<String, Value> = serde_json::from_slice(header).ok()?;
    let data_len = bytes.len() - 8 - n;
    let mut tensors = Vec::new();
    for (name, info) in map.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype_value = info.get("dtype")?;
        let Ok(dtype) = serde_json::from_value::<Dtype>(dtype_value.clone()) else {
            return Some(format!("tensor {name} has unknown dtype {dtype_value}"));
        };
        let shape: Vec<usize> = serde_json::from_value(info.get("shape")?.clone()).ok()?;
        let (start, end): (usize, usize) =
            serde_json::from_value(info.get("data_offsets")?.clone()).ok()?;
        let bits = shape
            .iter()
            .try_fold(dtype.bitsize(), |acc, &d| acc.checked_mul(d));
        let span_bits = end.checked_sub(start).and_then(|n| n.checked_mul(8));
        match (bits, span_bits) {
            (Some(bits), Some(span)) if bits == span => {}
            _ => {
                return Some(format!(
                    "tensor {name}: shape {shape:?} of {dtype} does not fit data_offsets [{start}, {end}]"
                ))
            }
        }
        tensors.push((start, end, name));
    }
    tensors.sort();
    let mut at = 0;
    for (start, end, name) in tensors {
        if end > data_len {
            return Some(format!(
                "tensor {name} ends at data byte {end} but the file holds only {data_len} data bytes (truncated?)"
            ));
        }
        if start != at {
            return Some(format!(
                "tensor {name} starts at data byte {start}, expected {at} (overlap or gap)"
            ));
        }
        at = end;
    }
    (at != data_len).then(|| format!("{} stray bytes after the last tensor", data_len - at))
}
