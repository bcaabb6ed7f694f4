//! Model weights in the one layout every execution path uses: bf16, row-major `[out, in]`
//! matrices as HF stores them, Q/K rows in HF (`rotate_half`) order.

use half::bf16;

#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[hidden]`
    pub attn_norm: Vec<bf16>,
    /// `[num_heads * head_dim, hidden]`
    pub wq: Vec<bf16>,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wk: Vec<bf16>,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wv: Vec<bf16>,
    /// `[hidden, num_heads * head_dim]`
    pub wo: Vec<bf16>,
    /// `[hidden]`
    pub ffn_norm: Vec<bf16>,
    /// `[intermediate, hidden]`
    pub w_gate: Vec<bf16>,
    /// `[intermediate, hidden]`
    pub w_up: Vec<bf16>,
    /// `[hidden, intermediate]`
    pub w_down: Vec<bf16>,
    /// Qwen3 `[head_dim]` gains of the per-head RMS norm of q and k; `None` without q/k norm.
    pub q_norm: Option<Vec<bf16>>,
    pub k_norm: Option<Vec<bf16>>,
    /// Qwen2 biases `[q_dim]`, `[kv_dim]`, `[kv_dim]` of the q, k and v projections.
    pub qkv_bias: Option<QkvBias>,
}

#[derive(Debug, Clone)]
pub struct QkvBias {
    pub q: Vec<bf16>,
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
}

#[derive(Debug, Clone)]
pub struct Weights {
    /// `[vocab, hidden]`
    pub embed: Vec<bf16>,
    pub layers: Vec<LayerWeights>,
    /// `[hidden]`
    pub final_norm: Vec<bf16>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Vec<bf16>>,
}

impl Weights {
    pub fn lm_head(&self) -> &[bf16] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// Bytes one decode step streams: every matrix once, the embedding row aside.
    pub fn bytes_per_token(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.wq.len()
                    + l.wk.len()
                    + l.wv.len()
                    + l.wo.len()
                    + l.ffn_norm.len()
                    + l.w_gate.len()
                    + l.w_up.len()
                    + l.w_down.len()
                    + l.q_norm.as_ref().map_or(0, Vec::len)
                    + l.k_norm.as_ref().map_or(0, Vec::len)
                    + l.qkv_bias
                        .as_ref()
                        .map_or(0, |b| b.q.len() + b.k.len() + b.v.len())
            })
            .sum();
        2 * (layer + self.final_norm.len() + self.lm_head().len())
    }
}
