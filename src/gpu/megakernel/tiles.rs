//! The tiles of each mat-vec instruction: how many of its weight rows one ring page takes and
//! how many pages its rows fill. They depend on the rows' storage format (a quantised row is a
//! fraction of a bf16 one), which the scheduler does not know, so the megakernel's host works
//! them out once per schedule and writes them into the instruction's last word (operand a5,
//! which no mat-vec's encoding uses): `rows_per_tile | tiles << 16`. The kernel's loader and
//! consumers read them there (`tile_geom`, megakernel/ops.cuh) instead of dividing at every
//! instruction's start, where the division sat on the critical path of the small shapes.
//!
//! Tile t goes to consumer warp pair t % TILE_GROUPS. A tile holds at most what a page does and
//! at most a quarter of the rows; where the rows fill more than TILE_GROUPS pages, the tile
//! count is rounded up to a multiple of TILE_GROUPS and the rows spread evenly over the tiles
//! when that leaves the busiest pair fewer rows (Llama-3.2-3B Q4_0's up-gate, 128 rows of
//! 1,728 bytes, 9 a page: 15 tiles, one pair 36 rows against 32, become 16 tiles of 8; on
//! the H100 that shape decodes 3.3% faster than with page-filling tiles, the others level,
//! BENCHMARKS.md). `MEGAINFER_MK_TILE_BALANCE=0` fills every page instead, and
//! `MEGAINFER_MK_TILE_ROWS=N` takes at most N rows a tile (what a page's fill is worth: Llama-1B's
//! 4 KiB rows at 3 a page fill 12 KiB of 16, as Llama-3.2-3B's two 6 KiB rows do), for measuring.

use anyhow::{bail, Result};
use scheduler::{Op, Schedule};

use super::abi::{PAGE_BYTES, TILE_GROUPS, WORDS};
use crate::model::{Config, WeightType};

/// The formats of the matrices the mat-vec instructions read: each layer's and the LM head's.
#[derive(Clone, Debug)]
pub struct TileFormats {
    /// Per layer: q/k/v, output, gate/up, down.
    pub layers: Vec<[WeightType; 4]>,
    pub lm_head: WeightType,
}

/// Bytes a row segment of `cols` columns takes in a page: a whole row as stored, or a chunk of
/// one with room for its scales at any offset within 16 bytes (megakernel/runtime.cuh's
/// `wt_row` and `wt_chunk_slot`).
pub fn slot_bytes(ty: WeightType, cols: usize, whole: bool) -> usize {
    match ty.quant() {
        None => 2 * cols,
        Some(q) => super::super::model::quantised_row_bytes(q, cols) + if whole { 0 } else { 16 },
    }
}

/// Rows per tile for `n` rows of `slot` bytes (see the module's comment): the page-filling
/// choice, or the balanced one where that leaves the busiest warp pair fewer rows.
pub fn rows_per_tile(slot: usize, n: usize, balance: bool) -> usize {
    let fit = (PAGE_BYTES / slot.max(1)).max(1);
    let filling = fit.min(n.div_ceil(TILE_GROUPS)).max(1);
    if balance && n > TILE_GROUPS * fit {
        let even = n.div_ceil(n.div_ceil(fit).next_multiple_of(TILE_GROUPS));
        if busiest_pair(n, even) < busiest_pair(n, filling) {
            return even;
        }
    }
    filling
}

/// The most rows one warp pair computes, tile t going to pair t % TILE_GROUPS.
fn busiest_pair(n: usize, rpt: usize) -> usize {
    let mut rows = [0; TILE_GROUPS];
    for t in 0..n.div_ceil(rpt) {
        rows[t % TILE_GROUPS] += rpt.min(n - t * rpt);
    }
    rows.into_iter().max().unwrap_or(0)
}

/// The weight rows, their length, their matrix's full width and format, of a mat-vec
/// instruction (megakernel/ops.cuh's `seg_count`, `seg_cols` and `op_matrix_cols`); None for
/// the others.
fn rows_of(op: &Op, c: &Config, f: &TileFormats) -> Option<(usize, usize, usize, WeightType)> {
    let layer = |l: u32, k: usize| f.layers.get(l as usize).map(|m| m[k]);
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    Some(match *op {
        Op::RmsQkvRope {
            layer: l,
            pair_count,
            ..
        } => (2 * pair_count as usize, h, h, layer(l, 0)?),
        Op::OProjResidual {
            layer: l,
            row_count,
            ..
        } => (row_count as usize, c.q_dim(), c.q_dim(), layer(l, 1)?),
        Op::RmsUpGateSilu {
            layer: l,
            row_count,
            ..
        } => (2 * row_count as usize, h, h, layer(l, 2)?),
        Op::DownProjPartial {
            layer: l,
            row_count,
            col_count,
            ..
        } => (row_count as usize, col_count as usize, inter, layer(l, 3)?),
        Op::RmsLmHead { row_count, .. } => (row_count as usize, h, h, f.lm_head),
        _ => return None,
    })
}

/// How the host cuts rows into tiles: `balance` (see the module's comment) and at most
/// `max_rows` rows a tile (`usize::MAX` by default).
#[derive(Clone, Copy, Debug)]
pub struct TileRule {
    pub balance: bool,
    pub max_rows: usize,
}

impl Default for TileRule {
    fn default() -> Self {
        TileRule {
            balance: true,
            max_rows: usize::MAX,
        }
    }
}

/// The tile word of `op` (0 for an instruction without weight rows).
pub fn tile_word(op: &Op, c: &Config, f: &TileFormats, rule: TileRule) -> Result<u32> {
    let Some((n, cols, matrix_cols, ty)) = rows_of(op, c, f) else {
        return Ok(0);
    };
    if n == 0 {
        return Ok(0);
    }
    let slot = slot_bytes(ty, cols, cols == matrix_cols);
    if slot > PAGE_BYTES {
        bail!("megakernel: {op:?} has rows of {slot} bytes; a {PAGE_BYTES}-byte page holds at most one");
    }
    let rpt = rows_per_tile(slot, n, rule.balance).min(rule.max_rows.max(1));
    let tiles = n.div_ceil(rpt);
    if rpt >= 1 << 16 || tiles >= 1 << 16 {
        bail!("megakernel: {op:?}: {tiles} tiles of {rpt} rows do not fit the tile word");
    }
    Ok(rpt as u32 | (tiles as u32) << 16)
}

/// Writes each mat-vec instruction's tile word into `words`, `schedule.encode()`'s words (the
/// streams' instructions in order).
pub fn write_tile_words(
    words: &mut [u32],
    schedule: &Schedule,
    c: &Config,
    f: &TileFormats,
    rule: TileRule,
) -> Result<()> {
    for (i, &k) in schedule.streams.iter().flatten().enumerate() {
        words[i * WORDS + WORDS - 1] = tile_word(&schedule.instrs[k as usize], c, f, rule)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets;

    /// The kernel's rule before the tiles came from the host (page-filling tiles).
    fn device_rule(slot: usize, n: usize) -> usize {
        (PAGE_BYTES / slot).min(n.div_ceil(TILE_GROUPS)).max(1)
    }

    #[test]
    fn tiles_hold_at_most_a_page_and_cover_the_rows() {
        for slot in [192, 1152, 1728, 2176, 2304, 4096, 4368, 8192, 16384] {
            for n in 1..=1100 {
                for balance in [false, true] {
                    let rpt = rows_per_tile(slot, n, balance);
                    let tiles = n.div_ceil(rpt);
                    assert!(
                        rpt * slot <= PAGE_BYTES,
                        "slot {slot} n {n}: {rpt} rows overflow a page"
                    );
                    assert!(
                        rpt <= n.div_ceil(TILE_GROUPS).max(1),
                        "slot {slot} n {n}: {rpt} rows, more than a quarter"
                    );
                    assert!(tiles * rpt >= n && (tiles - 1) * rpt < n);
                    if !balance || n <= TILE_GROUPS * (PAGE_BYTES / slot) {
                        assert_eq!(rpt, device_rule(slot, n), "slot {slot} n {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn balanced_tiles_never_load_a_pair_more() {
        for slot in [1152, 1728, 2176, 2304, 4368] {
            for n in 1..=1100 {
                let (old, new) = (device_rule(slot, n), rows_per_tile(slot, n, true));
                assert!(
                    busiest_pair(n, new) <= busiest_pair(n, old),
                    "slot {slot} n {n}"
                );
            }
        }
        // Llama-3.2-3B Q4_0's up-gate (hidden 3072: 1,728-byte rows, 9 a page) and Llama-1B
        // Q4_0's (2048: 1,152 bytes, 14 a page), 128 rows each.
        // (slot, balanced, rows a tile, the busiest pair's rows)
        for (slot, balance, rpt, busiest) in [
            (1728, false, 9, 36),
            (1728, true, 8, 32),
            (1152, false, 14, 42),
            (1152, true, 11, 33),
        ] {
            assert_eq!(
                (rows_per_tile(slot, 128, balance), busiest_pair(128, rpt)),
                (rpt, busiest),
                "slot {slot}, balanced {balance}"
            );
        }
    }

    /// `MEGAINFER_MK_TILE_ROWS`'s cap: Llama-1B's 2048-wide bf16 rows at most 3 a tile, so
    /// 12 KiB of a 16 KiB page, the rows still all covered.
    #[test]
    fn a_row_cap_bounds_every_tile() {
        let c = presets::by_name("llama-3.2-1b").unwrap();
        let f = TileFormats {
            layers: vec![[WeightType::Bf16; 4]; c.num_layers],
            lm_head: WeightType::Bf16,
        };
        let op = Op::RmsUpGateSilu {
            layer: 0,
            row_start: 0,
            row_count: 64,
        };
        let word = |max_rows| {
            let rule = TileRule {
                max_rows,
                ..TileRule::default()
            };
            let w = tile_word(&op, &c, &f, rule).unwrap();
            ((w & 0xffff) as usize, (w >> 16) as usize)
        };
        assert_eq!(word(usize::MAX), (4, 32));
        assert_eq!(word(3), (3, 43));
    }

    #[test]
    fn slots_follow_the_device_layout() {
        // Q4_0 at 2048 columns: 1,024 bytes of quants, 64 blocks' 2-byte scales (128).
        assert_eq!(slot_bytes(WeightType::Q4_0, 2048, true), 1152);
        assert_eq!(slot_bytes(WeightType::Q4_0, 4096, false), 2304 + 16);
        assert_eq!(slot_bytes(WeightType::Q8_0, 2048, true), 2176);
        assert_eq!(slot_bytes(WeightType::Bf16, 4096, false), 8192);
    }

    #[test]
    fn every_mat_vec_of_a_schedule_gets_a_tile_word() {
        let c = presets::by_name("llama-3.2-1b").unwrap();
        let shape = super::super::megakernel_gpu_shape(&c, 132, 232448);
        let model = crate::reference::sliced::shape_of(&c);
        let cost = scheduler::CostModel::megakernel(1024);
        let schedule =
            scheduler::plan_buckets_within(&model, &shape, &cost, &Default::default(), &[1024])
                .unwrap()
                .remove(0)
                .schedule;
        for ty in [WeightType::Bf16, WeightType::Q4_0, WeightType::Q8_0] {
            let f = TileFormats {
                layers: vec![[ty; 4]; c.num_layers],
                lm_head: ty,
            };
            let mut enc = schedule.encode();
            write_tile_words(&mut enc.words, &schedule, &c, &f, TileRule::default()).unwrap();
            for (i, &k) in schedule.streams.iter().flatten().enumerate() {
                let op = &schedule.instrs[k as usize];
                let w = enc.words[i * WORDS + WORDS - 1];
                match rows_of(op, &c, &f) {
                    Some((n, ..)) => {
                        let (rpt, tiles) = ((w & 0xffff) as usize, (w >> 16) as usize);
                        assert!(rpt >= 1 && tiles == n.div_ceil(rpt), "{op:?}: word {w:#x}");
                    }
                    None => assert_eq!(w, 0, "{op:?}"),
                }
            }
        }
    }
}
