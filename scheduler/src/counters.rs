//! The dense u32 counter array instructions signal and wait on.
//!
//! Layout, `K` = kv_heads, `C` = down chunks, `P` = 1 when attention is partitioned
//! (parts > 1) else 0; each layer owns a block of `per_layer = (2 + P)·K + 3 + C` counters
//! starting at `l · per_layer`:
//!
//! | offset in the layer block | counter | signalled by |
//! | --- | --- | --- |
//! | `g` (`g < K`) | `QkvQ[l][g]` | `RmsQkvRope` of the Q heads of group `g` |
//! | `K + g` | `QkvKv[l][g]` | `RmsQkvRope` of K head `g` and V head `g` |
//! | `2K + g` (only if P) | `AttnPart[l][g]` | `Attention` parts of KV head `g` |
//! | `(2+P)K` | `AttnDone[l]` | `AttnReduce` (or `Attention` when parts = 1) |
//! | `(2+P)K + 1` | `OProj[l]` | `OProjResidual` |
//! | `(2+P)K + 2 + c` | `UpGate[l][c]` | `RmsUpGateSilu` of rows in down chunk `c` |
//! | `(2+P)K + 2 + C` | `Down[l]` | `DownProjResidual` |
//!
//! then `LmHead` at `L · per_layer` (signalled by `RmsLmHead`) and `Done` at
//! `L · per_layer + 1` (signalled by `Argmax`; nothing waits on it: it tells the host that a
//! launch finished, `Done == epoch + 1`).
//!
//! Counters are never cleared: in launch `e` (0, 1, 2, …) every counter ends at
//! `signallers · (e + 1)`, and a wait with base target `b` waits for `counter >= b·(e + 1)`.
//! That holds until `signallers · (e + 1)` overflows u32; [`crate::Schedule::max_epochs`] gives
//! the limit, after which the host zeroes the counters and restarts epochs at 0.

use serde::{Deserialize, Serialize};

/// A counter by meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Counter {
    QkvQ { layer: u32, group: u32 },
    QkvKv { layer: u32, group: u32 },
    AttnPart { layer: u32, group: u32 },
    AttnDone { layer: u32 },
    OProj { layer: u32 },
    UpGate { layer: u32, chunk: u32 },
    Down { layer: u32 },
    LmHead,
    Done,
}

impl std::fmt::Display for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Counter::QkvQ { layer, group } => write!(f, "L{layer}.QkvQ[{group}]"),
            Counter::QkvKv { layer, group } => write!(f, "L{layer}.QkvKv[{group}]"),
            Counter::AttnPart { layer, group } => write!(f, "L{layer}.AttnPart[{group}]"),
            Counter::AttnDone { layer } => write!(f, "L{layer}.AttnDone"),
            Counter::OProj { layer } => write!(f, "L{layer}.OProj"),
            Counter::UpGate { layer, chunk } => write!(f, "L{layer}.UpGate[{chunk}]"),
            Counter::Down { layer } => write!(f, "L{layer}.Down"),
            Counter::LmHead => write!(f, "LmHead"),
            Counter::Done => write!(f, "Done"),
        }
    }
}

/// Maps [`Counter`]s to indices of the dense array and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterLayout {
    pub layers: u32,
    pub kv_heads: u32,
    pub chunks: u32,
    /// Whether `AttnPart` counters exist (attention partitioned).
    pub partitioned: bool,
}

impl CounterLayout {
    pub fn per_layer(&self) -> u32 {
        self.attn_done_offset() + 3 + self.chunks
    }

    fn attn_done_offset(&self) -> u32 {
        (2 + self.partitioned as u32) * self.kv_heads
    }

    /// Length of the counter array.
    pub fn count(&self) -> u32 {
        self.layers * self.per_layer() + 2
    }

    pub fn index(&self, c: Counter) -> u32 {
        let k = self.kv_heads;
        let d = self.attn_done_offset();
        let at = |layer: u32, off: u32| layer * self.per_layer() + off;
        match c {
            Counter::QkvQ { layer, group } => at(layer, group),
            Counter::QkvKv { layer, group } => at(layer, k + group),
            Counter::AttnPart { layer, group } => at(layer, 2 * k + group),
            Counter::AttnDone { layer } => at(layer, d),
            Counter::OProj { layer } => at(layer, d + 1),
            Counter::UpGate { layer, chunk } => at(layer, d + 2 + chunk),
            Counter::Down { layer } => at(layer, d + 2 + self.chunks),
            Counter::LmHead => self.layers * self.per_layer(),
            Counter::Done => self.layers * self.per_layer() + 1,
        }
    }

    /// The counter at `index`, `None` past the end.
    pub fn counter(&self, index: u32) -> Option<Counter> {
        let per = self.per_layer();
        let top = self.layers * per;
        if index >= self.count() {
            return None;
        }
        if index >= top {
            return Some(if index == top {
                Counter::LmHead
            } else {
                Counter::Done
            });
        }
        let (layer, off) = (index / per, index % per);
        let (k, d) = (self.kv_heads, self.attn_done_offset());
        Some(match off {
            o if o < k => Counter::QkvQ { layer, group: o },
            o if o < 2 * k => Counter::QkvKv {
                layer,
                group: o - k,
            },
            o if o < d => Counter::AttnPart {
                layer,
                group: o - 2 * k,
            },
            o if o == d => Counter::AttnDone { layer },
            o if o == d + 1 => Counter::OProj { layer },
            o if o < d + 2 + self.chunks => Counter::UpGate {
                layer,
                chunk: o - d - 2,
            },
            _ => Counter::Down { layer },
        })
    }

    /// Human-readable name of counter `index`.
    pub fn name(&self, index: u32) -> String {
        self.counter(index)
            .map_or_else(|| format!("#{index}?"), |c| c.to_string())
    }
}
