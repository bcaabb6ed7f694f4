//! A minimal GGUF (v3, little-endian) writer for crafting test files, valid or broken on purpose,
//! and a tiny but complete llama model to break.

/// Where the header's fields sit, for patching absurd values into a written file.
pub const TENSOR_COUNT_AT: usize = 8;
pub const METADATA_COUNT_AT: usize = 16;
pub const FIRST_KEY_LENGTH_AT: usize = 24;

const ALIGNMENT: usize = 32;

pub enum Val {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    /// A value type id followed by whatever bytes a test wants the reader to find.
    Raw(u32, Vec<u8>),
}

pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
    /// Written instead of the offset the writer would compute.
    pub offset: Option<u64>,
}

#[derive(Default)]
pub struct Gguf {
    pub kvs: Vec<(String, Val)>,
    pub tensors: Vec<Tensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    /// Sets a key, replacing its value if present.
    pub fn set(&mut self, key: &str, val: Val) -> &mut Self {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some(kv) => kv.1 = val,
            None => self.kvs.push((key.to_string(), val)),
        }
        self
    }

    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(Tensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
            offset: None,
        });
        self
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.name != name);
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (key, val) in &self.kvs {
            put_str(&mut out, key);
            match val {
                Val::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Val::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Val::Bool(v) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(u8::from(*v));
                }
                Val::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Val::Strs(v) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((v.len() as u64).to_le_bytes());
                    v.iter().for_each(|s| put_str(&mut out, s));
                }
                Val::I32s(v) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((v.len() as u64).to_le_bytes());
                    v.iter().for_each(|x| out.extend(x.to_le_bytes()));
                }
                Val::Raw(ty, bytes) => {
                    out.extend(ty.to_le_bytes());
                    out.extend(bytes);
                }
            }
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.ty.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
            offset += t.data.len().next_multiple_of(ALIGNMENT) as u64;
        }
        for t in &self.tensors {
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
            out.extend(&t.data);
        }
        out
    }
}

/// Deterministic small values, so a tiny model's weights are not all equal.
fn f32_data(n: u64, seed: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let x = ((i * 2654435761 + seed * 97) % 1000) as f32 / 1000.0 - 0.5;
            (x * 0.1).to_le_bytes()
        })
        .collect()
}

pub const TINY_HIDDEN: u64 = 64;
pub const TINY_FFN: u64 = 128;
pub const TINY_KV_DIM: u64 = 32;
pub const TINY_VOCAB: u64 = 32;

/// A llama model's metadata and no tensors: `layers` blocks, context `context`, hidden `h`,
/// feed-forward `f`, `heads` attention heads of which `kv_heads` for K/V, vocabulary `v`.
/// Keys in a fixed order, so a file written from it is the same byte for byte every time.
pub fn llama_metadata(
    layers: u32,
    context: u32,
    h: u64,
    f: u64,
    heads: u32,
    kv_heads: u32,
    v: u64,
) -> Gguf {
    let mut g = Gguf::default();
    g.set("general.architecture", Val::Str("llama".into()))
        .set("general.alignment", Val::U32(ALIGNMENT as u32))
        .set("llama.block_count", Val::U32(layers))
        .set("llama.context_length", Val::U32(context))
        .set("llama.embedding_length", Val::U32(h as u32))
        .set("llama.feed_forward_length", Val::U32(f as u32))
        .set("llama.attention.head_count", Val::U32(heads))
        .set("llama.attention.head_count_kv", Val::U32(kv_heads))
        .set("llama.rope.freq_base", Val::F32(10000.0))
        .set("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5))
        .set("llama.vocab_size", Val::U32(v as u32));
    g
}

/// A complete 2-layer llama model with F32 weights: 4 heads of 16, 2 kv heads, no tokenizer.
pub fn tiny_llama() -> Gguf {
    let (h, f, kv, v) = (TINY_HIDDEN, TINY_FFN, TINY_KV_DIM, TINY_VOCAB);
    let mut g = llama_metadata(2, 256, h, f, 4, 2, v);
    let mut add = |name: String, dims: &[u64]| {
        let seed = g.tensors.len() as u64;
        g.add_tensor(&name, dims, 0, f32_data(dims.iter().product(), seed));
    };
    add("token_embd.weight".into(), &[h, v]);
    for l in 0..2 {
        add(format!("blk.{l}.attn_norm.weight"), &[h]);
        add(format!("blk.{l}.attn_q.weight"), &[h, h]);
        add(format!("blk.{l}.attn_k.weight"), &[h, kv]);
        add(format!("blk.{l}.attn_v.weight"), &[h, kv]);
        add(format!("blk.{l}.attn_output.weight"), &[h, h]);
        add(format!("blk.{l}.ffn_norm.weight"), &[h]);
        add(format!("blk.{l}.ffn_gate.weight"), &[h, f]);
        add(format!("blk.{l}.ffn_up.weight"), &[h, f]);
        add(format!("blk.{l}.ffn_down.weight"), &[f, h]);
    }
    add("output_norm.weight".into(), &[h]);
    g
}

/// Byte-level BPE metadata for the tiny model: letters, one merge, and control tokens.
pub fn add_tiny_tokenizer(g: &mut Gguf) {
    let mut tokens: Vec<String> = ('a'..='z').map(String::from).collect();
    tokens.extend(["ab", "Ġ", "<s>", "</s>", "<|im_start|>", "<|im_end|>"].map(String::from));
    assert_eq!(tokens.len() as u64, TINY_VOCAB);
    let types = (0..TINY_VOCAB)
        .map(|i| if i >= 28 { 3 } else { 1 })
        .collect();
    g.set("tokenizer.ggml.model", Val::Str("gpt2".into()))
        .set("tokenizer.ggml.pre", Val::Str("smollm".into()))
        .set("tokenizer.ggml.tokens", Val::Strs(tokens))
        .set("tokenizer.ggml.token_type", Val::I32s(types))
        .set("tokenizer.ggml.merges", Val::Strs(vec!["a b".into()]))
        .set("tokenizer.ggml.bos_token_id", Val::U32(28))
        .set("tokenizer.ggml.eos_token_id", Val::U32(29))
        .set("tokenizer.ggml.eot_token_id", Val::U32(31))
        .set("tokenizer.ggml.add_bos_token", Val::Bool(true));
}
