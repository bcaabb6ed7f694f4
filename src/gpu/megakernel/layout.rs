//! Resource planning, pure arithmetic (unit-tested without a GPU): the shared-memory carve-up
//! (also emitted as the kernel's `MK_SMEM_*` macros, so both sides use this one plan), the
//! attention scratch and the tagged-activation arena.

use anyhow::{bail, Result};

use super::abi::{LayerW, ATT_ROUND, CONSUMER_WARPS, PAGE_BYTES, RES_MAX, TILE_GROUPS, WORDS};

/// How a shared-memory region's size follows from the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Size {
    /// Bytes per page of the ring (`p.pages`).
    PerPage(usize),
    /// Bytes per float of `xs` (`p.xs_floats`).
    PerXsFloat(usize),
    /// Bytes per layer (`p.n_layers`).
    PerLayer(usize),
    /// A fixed number of bytes.
    Fixed(usize),
}

/// The regions in order (CUDA: `MK_SMEM_<NAME>(p)`, the byte offset from the start).
const REGIONS: [(&str, Size); 9] = [
    ("pages", Size::PerPage(PAGE_BYTES)),
    ("xs", Size::PerXsFloat(4)),
    ("res", Size::Fixed(2 * RES_MAX * 4)),
    ("red", Size::Fixed(2 * CONSUMER_WARPS * 4)),
    ("ss", Size::Fixed(CONSUMER_WARPS * 4)),
    ("iws", Size::Fixed(2 * WORDS * 4)),
    ("lw", Size::PerLayer(std::mem::size_of::<LayerW>())),
    ("full", Size::PerPage(8)),
    ("empty", Size::PerPage(8)),
];

/// The dynamic shared memory of one CTA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmemLayout {
    pub pages: usize,
    pub xs_floats: usize,
    pub n_layers: usize,
    /// (region, byte offset, bytes), in order.
    pub regions: Vec<(&'static str, usize, usize)>,
    /// Bytes in all (the launch's dynamic shared memory).
    pub bytes: usize,
}

impl SmemLayout {
    /// The carve-up for a given page count.
    pub fn with_pages(pages: usize, xs_floats: usize, n_layers: usize) -> Self {
        let mut off = 0;
        let regions = REGIONS
            .iter()
            .map(|&(name, size)| {
                let n = match size {
                    Size::PerPage(b) => pages * b,
                    Size::PerXsFloat(b) => xs_floats * b,
                    Size::PerLayer(b) => n_layers * b,
                    Size::Fixed(b) => b,
                };
                let start = off;
                off += n;
                (name, start, n)
            })
            .collect();
        SmemLayout {
            pages,
            xs_floats,
            n_layers,
            regions,
            bytes: off,
        }
    }

    /// As many pages as fit in `max_bytes` beside the kernel's `static_bytes`, a multiple of
    /// TILE_GROUPS (so each page is always consumed by the same warp pair).
    pub fn plan(
        max_bytes: usize,
        static_bytes: usize,
        xs_floats: usize,
        n_layers: usize,
    ) -> Result<Self> {
        let fixed = Self::with_pages(0, xs_floats, n_layers).bytes;
        let per_page = Self::with_pages(1, xs_floats, n_layers).bytes - fixed;
        let pages =
            max_bytes.saturating_sub(fixed + static_bytes) / per_page / TILE_GROUPS * TILE_GROUPS;
        if pages < TILE_GROUPS {
            bail!(
                "megakernel: {max_bytes} B of shared memory per block leaves {pages} pages; at least {TILE_GROUPS} are needed"
            );
        }
        Ok(Self::with_pages(pages, xs_floats, n_layers))
    }

    /// (offset, bytes) of a region.
    pub fn region(&self, name: &str) -> (usize, usize) {
        self.regions
            .iter()
            .find(|r| r.0 == name)
            .map(|r| (r.1, r.2))
            .expect("a shared-memory region of REGIONS")
    }
}

/// The CUDA macros `MK_SMEM_<REGION>(p)`: each region's byte offset, from the launch's
/// `p.pages`, `p.xs_floats` and `p.n_layers`, as a chain of sums like the plan above.
pub fn smem_macros() -> String {
    let mut s = String::new();
    let mut prev = String::from("(size_t)0");
    for (name, size) in REGIONS {
        let m = format!("MK_SMEM_{}(p)", name.to_uppercase());
        s += &format!("#define {m} ({prev})\n");
        let n = match size {
            Size::PerPage(b) => format!("(size_t)(p).pages * {b}"),
            Size::PerXsFloat(b) => format!("(size_t)(p).xs_floats * {b}"),
            Size::PerLayer(b) => format!("(size_t)(p).n_layers * {b}"),
            Size::Fixed(b) => format!("{b}"),
        };
        prev = format!("{m} + {n}");
    }
    s
}

/// Partial outputs attention's rounds keep (`MK_ATT_PART_SLOTS` for megakernel/ops/attention.cuh):
/// one a consumer warp, or one a warp pair where the heads' outputs are more than 512 floats
/// (Qwen2.5-7B's whole groups of 7 heads of 128, which its split-KV buckets compute): with a
/// slot a warp their scratch left the weight ring 8 pages instead of 12.
pub fn attention_part_slots(group: usize, head_dim: usize) -> usize {
    if group * head_dim > 512 {
        CONSUMER_WARPS / 2
    } else {
        CONSUMER_WARPS
    }
}

/// Floats of shared memory the attention instruction uses (the layout at the top of
/// megakernel/ops/attention.cuh, which checks its size against this one): scores for a round
/// of staged positions and this token's, the partial outputs ([`attention_part_slots`]), the
/// running output, the queries, this token's K and V rows, and three numbers per head.
pub fn attention_scratch(group: usize, head_dim: usize) -> usize {
    let round_stride = ATT_ROUND + 4;
    let slots = attention_part_slots(group, head_dim);
    group * round_stride + (slots + 2) * group * head_dim + 2 * head_dim + 3 * group
}

/// Floats of `xs`: the longest mat-vec input row, or the attention scratch less the `res`
/// region that follows `xs`, whichever is more, rounded up to 16 bytes. Attention (an
/// instruction of its own) takes `xs` and `res` together as its scratch: `res` holds a
/// mat-vec's outputs only within that instruction. Sizing `xs` for the whole scratch cost
/// head_dim 128 shapes a third of their pages (Llama-3.2-3B and 3.1-8B: 8 instead of 12, the
/// page count being a multiple of TILE_GROUPS).
pub fn xs_floats(max_cols: usize, attention_scratch: usize) -> usize {
    max_cols
        .max(attention_scratch.saturating_sub(2 * RES_MAX))
        .next_multiple_of(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention's scratch runs from `xs` into `res`: the two must follow each other, and
    /// together hold it, for every supported attention shape.
    #[test]
    fn attention_scratch_fits_xs_and_res_together() {
        let l = SmemLayout::with_pages(12, xs_floats(576, attention_scratch(8, 128)), 32);
        let (xs, xs_len) = l.region("xs");
        let (res, res_len) = l.region("res");
        assert_eq!(xs + xs_len, res, "res must follow xs");
        for (group, hd) in [
            (1, 64),
            (3, 64),
            (4, 64),
            (8, 64),
            (2, 128),
            (4, 128),
            (7, 128),
            (8, 128),
        ] {
            for max_cols in [576, 2048, 4096] {
                let scratch = attention_scratch(group, hd);
                let n = xs_floats(max_cols, scratch);
                assert!(n >= max_cols && n.is_multiple_of(4));
                assert!(
                    4 * n + res_len >= 4 * scratch,
                    "group {group}, head_dim {hd}"
                );
            }
        }
    }

    /// Llama-3.2-3B and Llama-3.1-8B (head_dim 128) keep 12 pages on an H100 (227 KiB a block).
    #[test]
    fn head_dim_128_llamas_keep_twelve_pages() {
        for (max_cols, group, layers) in [(4096, 3, 28), (4096, 4, 32)] {
            let xs = xs_floats(max_cols, attention_scratch(group, 128));
            let l = SmemLayout::plan(232_448, 16, xs, layers).unwrap();
            assert_eq!(l.pages, 12, "group {group}, {layers} layers");
        }
    }

    /// An H100's opt-in shared memory per block.
    const H100_SMEM: usize = 227 * 1024;

    #[test]
    fn regions_are_contiguous_aligned_and_fit() {
        // Llama-3.2-1B: 16 layers, rows of 2048 and 8192 / chunks columns.
        let xs = xs_floats(4096, attention_scratch(4, 64));
        let l = SmemLayout::plan(H100_SMEM, 8, xs, 16).unwrap();
        assert_eq!(l.pages % TILE_GROUPS, 0);
        assert_eq!(l.pages, 12, "{l:?}");
        assert!(l.bytes + 8 <= H100_SMEM);
        let mut end = 0;
        for &(name, off, n) in &l.regions {
            assert_eq!(off, end, "{name} follows the region before it");
            end = off + n;
            let align = match name {
                "pages" | "xs" | "res" => 16,
                _ => 8,
            };
            assert_eq!(
                off % align,
                0,
                "{name} at {off} is not {align}-byte aligned"
            );
        }
        assert_eq!(end, l.bytes);
        assert_eq!(l.region("xs").1, 4 * xs);
        assert_eq!(l.region("full").1, 8 * l.pages);
        // One more page group would not fit.
        let more = SmemLayout::with_pages(l.pages + TILE_GROUPS, xs, 16);
        assert!(more.bytes + 8 > H100_SMEM);
    }

    #[test]
    fn too_little_shared_memory_is_an_error() {
        let e = SmemLayout::plan(48 * 1024, 0, 4096, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 4"), "{e}");
    }

    #[test]
    fn the_macros_follow_the_plan() {
        let m = smem_macros();
        assert!(m.contains("#define MK_SMEM_PAGES(p) ((size_t)0)\n"), "{m}");
        assert!(
            m.contains("#define MK_SMEM_XS(p) (MK_SMEM_PAGES(p) + (size_t)(p).pages * 16384)\n"),
            "{m}"
        );
        assert!(
            m.contains("#define MK_SMEM_EMPTY(p) (MK_SMEM_FULL(p) + (size_t)(p).pages * 8)\n"),
            "{m}"
        );
        assert_eq!(m.lines().count(), REGIONS.len());
    }

    #[test]
    fn attention_scratch_by_hand() {
        // group 4, head_dim 64: S 4·260, partial outputs 8·4·64, output and queries 2·4·64,
        // K and V 2·64, stats 3·4.
        assert_eq!(attention_scratch(4, 64), 1040 + 2048 + 512 + 128 + 12);
        // group 7, head_dim 128 (Qwen2.5-7B's whole groups): a partial output a warp pair, 4·7·128.
        assert_eq!(attention_part_slots(7, 128), 4);
        assert_eq!(attention_part_slots(4, 128), 8);
        assert_eq!(attention_scratch(7, 128), 1820 + 3584 + 1792 + 256 + 21);
        // The scratch past 2 * RES_MAX floats only counts.
        assert_eq!(xs_floats(2048, 3740), 2048);
        assert_eq!(xs_floats(2048, 8000), 8000 - 4096);
        assert_eq!(xs_floats(4097, 10), 4100);
    }
}
