//! The interface between the host and the interpreter, defined once, here: the constants both
//! sides size things with, the parameter block, the layer pointer table, the progress stages,
//! the error kinds and the profile words. [`prelude`] emits them as CUDA for the compile, and
//! [`checks`] emits `static_assert`s that compare the CUDA structs' layout with these, so a
//! mismatch is a compile error, not a wrong pointer on the GPU.

use std::fmt::Write;
use std::mem::{offset_of, size_of};

use scheduler::encode::opcode;

/// Words per encoded instruction (the scheduler's encoding).
pub const WORDS: usize = scheduler::encode::WORDS_PER_INSTR;
/// Consumer warps per CTA; with the loader warp, 9 warps (see runtime.cuh on registers).
pub const CONSUMER_WARPS: usize = 8;
/// Threads per CTA: the loader warp and the consumer warps.
pub const THREADS: u32 = (CONSUMER_WARPS as u32 + 1) * 32;
/// Tiles go round-robin to pairs of consumer warps; the page count is a multiple of this.
pub const TILE_GROUPS: usize = CONSUMER_WARPS / 2;
/// Weight rows one mat-vec instruction may compute (two floats each in shared memory).
pub const RES_MAX: usize = 2048;
/// Bytes per page of the shared-memory ring: 16 KiB, or for measuring, what
/// `MEGAINFER_PAGE_BYTES` says in the build's environment (`MEGAINFER_PAGE_BYTES=24576 cargo
/// build --release`: 8 pages of 24 KiB, which four 6 KiB rows fill where two fill three
/// quarters of a 16 KiB page; 12288: 16 pages of 12 KiB, two such rows each; a multiple of
/// 1024 from 8 KiB to 32 KiB, else the build fails).
pub const PAGE_BYTES: usize = page_bytes(option_env!("MEGAINFER_PAGE_BYTES"));
/// Bytes of an attention K/V tile (its K and V rows for `MK_ATT_TILE_BYTES / (4 × head_dim)`
/// positions), at most a page: 16 KiB, or 8 KiB in pages smaller than that.
pub const ATT_TILE_BYTES: usize = if PAGE_BYTES >= 16384 { 16384 } else { 8192 };

const fn page_bytes(v: Option<&str>) -> usize {
    let n = match v {
        None => return 16384,
        Some(v) => match usize::from_str_radix(v, 10) {
            Ok(n) => n,
            Err(_) => panic!("MEGAINFER_PAGE_BYTES: not a number"),
        },
    };
    assert!(
        n >= 8192 && n <= 32768 && n % 1024 == 0,
        "MEGAINFER_PAGE_BYTES: a multiple of 1024 from 8192 to 32768"
    );
    n
}
/// Staged K/V positions per attention round (scores scratch is sized for it).
pub const ATT_ROUND: usize = 256;
/// The in-launch draw's gate words at the start of `lm_sample` (megakernel/ops/sample.cuh):
/// the hint, then statistics (draws that searched, draws, the searches for want of a hint,
/// for keys past the slots, for keys short of the cuts, and the draws decided by the top
/// token alone).
pub const SMP_GATE: [(&str, usize); 7] = [
    ("HINT", 0),
    ("SEARCHES", 1),
    ("DRAWS", 2),
    ("NO_HINT", 3),
    ("SLOTS", 4),
    ("SHORT", 5),
    ("TOP", 6),
];

const _: () = assert!(SMP_GATE.len() <= scheduler::arena::SAMPLE_GATE_WORDS);

/// A gate word's index by name.
pub fn smp_gate(name: &str) -> usize {
    SMP_GATE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, i)| i)
        .expect("a gate word of SMP_GATE")
}

/// The period of the in-launch draw's short slot tags (`MK_SMP_SLOT_PERIOD`,
/// megakernel/ops/sample.cuh).
pub const SMP_SLOT_PERIOD: u32 = 16383;

/// The largest vocabulary the in-launch draw takes: its key slots keep a token's 18 bits.
pub const SAMPLE_MAX_VOCAB: usize = 1 << 18;

/// LM-head blocks the in-launch draw merges at most (one summary per consumer thread); a
/// schedule with more draws after the launch instead.
pub const SAMPLE_MAX_BLOCKS: usize = CONSUMER_WARPS * 32;

/// Profile words per instruction, by index (globaltimer ns).
pub mod prof {
    /// The instruction started.
    pub const START: usize = 0;
    /// Inputs arrived and prepared (attention: inputs arrived).
    pub const PREPARED: usize = 1;
    /// Weight tiles done (attention: its whole computation).
    pub const TILES: usize = 2;
    /// Results stored, the CTA past its barrier.
    pub const STORED: usize = 3;
    /// Mat-vec: the loader's first page wait; attention: scores and softmax done.
    pub const EXTRA1: usize = 4;
    /// Mat-vec: the loader's last tile issued; attention: weighted values done (last round).
    pub const EXTRA2: usize = 5;
    /// Words per instruction.
    pub const WORDS: usize = 6;
    /// Names, by index (CUDA's `PROF_*`, lower case).
    pub const NAMES: [&str; WORDS] = ["start", "prepared", "tiles", "stored", "extra1", "extra2"];
}
pub const PROF_WORDS: usize = prof::WORDS;

/// A consumer's progress stage (progress word 1 of its SM), in order: (CUDA name, shown name).
/// The default build notes only the start, `ST_PREPARE` and the end of an instruction, so an
/// SM "under way" may be preparing, on its tiles or storing; a build with `-DMK_STAGE_NOTES=1`
/// also notes the tiles and the storing (megakernel.cu).
pub const STAGES: [(&str, &str); 5] = [
    ("ST_START", "start"),
    ("ST_PREPARE", "under way"),
    ("ST_TILES", "tiles"),
    ("ST_POST", "storing"),
    ("ST_DONE", "done"),
];
/// The stage of an instruction that finished.
pub const ST_DONE: u32 = STAGES.len() as u32 - 1;

/// Error kinds (error word 6): (CUDA name, value).
pub const ERROR_KINDS: [(&str, u32); 4] = [
    ("ERR_DATA", ERR_DATA),
    ("ERR_PAGE_CONSUMER", ERR_PAGE_CONSUMER),
    ("ERR_PAGE_LOADER", ERR_PAGE_LOADER),
    ("ERR_STEP", ERR_STEP),
];
/// A tagged input was not written in time.
pub const ERR_DATA: u32 = 1;
/// A consumer waited too long for a page's copies.
pub const ERR_PAGE_CONSUMER: u32 = 2;
/// The loader waited too long for a page to be released.
pub const ERR_PAGE_LOADER: u32 = 3;
/// In a generation: the previous step's token (what = `GEN_WHAT_TOKEN`), or an SM's end of
/// the previous step (what = the SM), did not come in time.
pub const ERR_STEP: u32 = 4;
/// ERR_STEP's `what` for the token.
pub const GEN_WHAT_TOKEN: u32 = u32::MAX;

/// The opcodes as the interpreter names them.
const OPCODES: [(&str, u32); 9] = [
    ("OP_NOOP", 0),
    ("OP_QKV", opcode::RMS_QKV_ROPE),
    ("OP_ATTN", opcode::ATTENTION),
    ("OP_ATTN_REDUCE", opcode::ATTN_REDUCE),
    ("OP_OPROJ", opcode::O_PROJ_RESIDUAL),
    ("OP_UPGATE", opcode::RMS_UP_GATE_SILU),
    ("OP_DOWN", opcode::DOWN_PROJ_PARTIAL),
    ("OP_LMHEAD", opcode::RMS_LM_HEAD),
    ("OP_ARGMAX", opcode::ARGMAX),
];

/// A `#[repr(C)]` struct whose field offsets are listed for [`checks`].
macro_rules! abi_struct {
    ($(#[$m:meta])* $vis:vis struct $name:ident { $($(#[$fm:meta])* $f:ident : $t:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default)]
        $vis struct $name { $($(#[$fm])* pub $f: $t,)* }
        impl $name {
            /// (field, byte offset), in declaration order.
            pub const FIELDS: &'static [(&'static str, usize)] =
                &[$((stringify!($f), offset_of!($name, $f)),)*];
        }
    };
}

abi_struct! {
    /// The kernel's one parameter (`MkParams` in runtime.cuh): device pointers as u64.
    pub struct MkParams {
        instrs: u64,
        sm_offsets: u64,
        kv_last: u64,
        error: u64,
        progress: u64,
        profile: u64,
        meta: u64,
        history: u64,
        layers: u64,
        embed: u64,
        final_norm: u64,
        lm_head: u64,
        inv_freq: u64,
        k_cache: u64,
        v_cache: u64,
        resid_attn: u64,
        mlp_part: u64,
        q: u64,
        kv_new: u64,
        attn_out: u64,
        attn_part: u64,
        act: u64,
        lm_best: u64,
        logits: u64,
        hidden: i32,
        inter: i32,
        heads: i32,
        kv_heads: i32,
        head_dim: i32,
        vocab: i32,
        n_layers: i32,
        chunks: i32,
        max_seq: i32,
        n_lm: i32,
        xs_floats: i32,
        pages: i32,
        eps: f32,
        epoch: u32,
        timeout_ns: u64,
        gen: u64,
        gen_out: u64,
        gen_ctl: u64,
        stop_ids: u64,
        gen_prof: u64,
        steps: u32,
        n_stop: u32,
        lm_sample: u64,
        smp_temperature: f32,
        smp_top_p: f32,
        smp_min_p: f32,
        smp_penalty: f32,
        smp_top_k: u32,
        smp_last_n: u32,
        smp_seed_lo: u32,
        smp_seed_hi: u32,
        sampling: u32,
        smp_pad: u32,
    }
}

abi_struct! {
    /// One layer's weight pointers (`LayerW` in runtime.cuh), copied to shared memory.
    pub struct LayerW {
        attn_norm: u64,
        w_qkv: u64,
        wo: u64,
        ffn_norm: u64,
        w_gu: u64,
        w_down: u64,
        /// Qwen2's q/k/v biases, Qwen3's per-head q and k norms: 0 where the model has none.
        qkv_bias: u64,
        q_norm: u64,
        k_norm: u64,
    }
}

// SAFETY: LayerW is #[repr(C)], nine u64 and no padding: any bit pattern is valid on both sides.
unsafe impl cudarc::driver::DeviceRepr for LayerW {}

abi_struct! {
    /// The per-step token slot (`TokenMeta` in common.cuh); two of them, by epoch parity.
    pub struct TokenMeta {
        token: u32,
        pos: u32,
        next: u32,
        pad: u32,
    }
}

/// Every CUDA definition that comes from here; goes after common.cuh, before the interpreter.
pub fn prelude() -> String {
    let mut s =
        String::from("// Generated by src/gpu/megakernel/abi.rs: the host's definitions.\n");
    for (name, v) in [
        ("MK_WORDS", WORDS),
        ("CONSUMER_WARPS", CONSUMER_WARPS),
        ("TILE_GROUPS", TILE_GROUPS),
        ("RES_MAX", RES_MAX),
        ("PAGE_BYTES", PAGE_BYTES),
        ("MK_ATT_TILE_BYTES", ATT_TILE_BYTES),
        ("PROF_WORDS", PROF_WORDS),
        ("MK_ATT_ROUND", ATT_ROUND),
        ("MK_SMP_MAX_BLOCKS", SAMPLE_MAX_BLOCKS),
        ("MK_SMP_SLOT_PERIOD", SMP_SLOT_PERIOD as usize),
        ("MK_SMP_BLK_WORDS", scheduler::arena::SAMPLE_SUMMARY_WORDS),
        ("MK_SMP_GATE_WORDS", scheduler::arena::SAMPLE_GATE_WORDS),
        ("MK_SMP_CAP", scheduler::arena::SAMPLE_KEY_SLOTS),
        ("MK_SMP_BLOCK_WORDS", scheduler::arena::SAMPLE_BLOCK_WORDS),
    ] {
        writeln!(s, "#define {name} {v}").unwrap();
    }
    for (name, i) in SMP_GATE {
        writeln!(s, "#define MK_SMP_GATE_{name} {i}").unwrap();
    }
    writeln!(s, "#define GEN_WHAT_TOKEN {GEN_WHAT_TOKEN}u").unwrap();
    for (i, name) in prof::NAMES.iter().enumerate() {
        writeln!(s, "#define PROF_{} {i}", name.to_uppercase()).unwrap();
    }
    let list = |items: Vec<String>| items.join(", ");
    writeln!(
        s,
        "enum Op : u32 {{ {} }};",
        list(OPCODES.iter().map(|(n, v)| format!("{n} = {v}")).collect())
    )
    .unwrap();
    writeln!(
        s,
        "enum Stage : u32 {{ {} }};",
        list(
            STAGES
                .iter()
                .enumerate()
                .map(|(i, (n, _))| format!("{n} = {i}"))
                .collect()
        )
    )
    .unwrap();
    writeln!(
        s,
        "enum ErrorKind : u32 {{ {} }};",
        list(
            ERROR_KINDS
                .iter()
                .map(|(n, v)| format!("{n} = {v}"))
                .collect()
        )
    )
    .unwrap();
    s += &super::layout::smem_macros();
    s
}

/// `static_assert`s that the CUDA structs have exactly the host's layout; goes at the end.
///
/// The field offsets need `__builtin_offsetof` as a constant expression, which NVRTC has from
/// 13.5 on (13.0 lacks it, and has no `offsetof` usable in a `static_assert`): older compilers
/// check the sizes only. Struct layout does not depend on the compiler's version, so the test
/// command (NVRTC 13.5 from the wheel) checks every offset for all of them.
pub fn checks() -> String {
    let mut s = String::from("// Generated by src/gpu/megakernel/abi.rs: layout checks.\n");
    let mut offsets = String::new();
    let mut one = |name: &str, size: usize, fields: &[(&str, usize)]| {
        writeln!(
            s,
            "static_assert(sizeof({name}) == {size}, \"{name}: the host's struct is {size} bytes (src/gpu/megakernel/abi.rs)\");"
        )
        .unwrap();
        for (f, off) in fields {
            writeln!(
                offsets,
                "static_assert(__builtin_offsetof({name}, {f}) == {off}, \"{name}.{f}: the host has it at byte {off} (src/gpu/megakernel/abi.rs)\");"
            )
            .unwrap();
        }
    };
    one("MkParams", size_of::<MkParams>(), MkParams::FIELDS);
    one("LayerW", size_of::<LayerW>(), LayerW::FIELDS);
    one("TokenMeta", size_of::<TokenMeta>(), TokenMeta::FIELDS);
    s += "#if defined(__has_builtin)\n#if __has_builtin(__builtin_offsetof)\n";
    s += &offsets;
    s += "#endif\n#endif\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_end_with_done_and_opcodes_are_distinct() {
        assert_eq!(STAGES[ST_DONE as usize].1, "done");
        let mut codes: Vec<u32> = OPCODES.iter().map(|o| o.1).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), OPCODES.len());
    }

    #[test]
    fn prelude_defines_every_constant_once() {
        let p = prelude();
        for name in [
            "MK_WORDS",
            "CONSUMER_WARPS",
            "PAGE_BYTES",
            "PROF_WORDS",
            "PROF_EXTRA2",
            "MK_SMEM_EMPTY(p)",
        ] {
            assert_eq!(
                p.matches(&format!("#define {name} ")).count(),
                1,
                "{name} in\n{p}"
            );
        }
        assert!(p.contains(&format!("ST_DONE = {ST_DONE}")), "{p}");
        assert!(p.contains(&format!("#define MK_WORDS {WORDS}\n")), "{p}");
    }

    #[test]
    fn checks_cover_every_field() {
        let c = checks();
        for (f, off) in MkParams::FIELDS {
            assert!(
                c.contains(&format!("__builtin_offsetof(MkParams, {f}) == {off},")),
                "{f}"
            );
        }
        assert!(c.contains(&format!(
            "sizeof(MkParams) == {}",
            std::mem::size_of::<MkParams>()
        )));
        // The parameter block: 30 pointers, 26 four-byte fields and the timeout, no padding.
        assert_eq!(std::mem::size_of::<MkParams>(), 30 * 8 + 26 * 4 + 8);
        assert_eq!(std::mem::size_of::<LayerW>(), 72);
    }
}
