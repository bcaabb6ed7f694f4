//! The megakernel across the wrap-around of its 32-bit step tag: the arena is cleared and the
//! epoch restarts at 0, and greedy decoding must go on exactly as in a run that never wraps.

use megainfer::generate::Backend;
use megainfer::gpu::device::Gpu;
use megainfer::gpu::megakernel::{schedule_for, MegakernelPath, MAX_EPOCH};
use megainfer::gpu::model::DeviceModel;
use megainfer::model::{presets, random::random_weights};
use megainfer::reference::rel_l2;
use megainfer::sampling::argmax;

const PROMPT: [u32; 4] = [17, 230, 5, 901];
/// Greedy steps before the epoch is moved, and after.
const BEFORE: usize = 5;
const AFTER: usize = 15;

/// Prompt, BEFORE greedy steps, then (with `flip`) a jump of the epoch to about AFTER / 2
/// steps before the wrap, with the parity changed (`Some(true)`: the two token slots trade
/// places) or kept, then AFTER greedy steps and the logits of one more fed token.
/// Returns the greedy tokens, those logits, and the epochs before and after the jump and at
/// the end.
fn run(mk: &mut MegakernelPath, flip: Option<bool>) -> (Vec<u32>, Vec<f32>, [u32; 3]) {
    mk.reset();
    let first = argmax(&mk.feed(&PROMPT).unwrap());
    let mut toks = vec![first];
    toks.extend(mk.decode_greedy(first, BEFORE).unwrap());
    let before = mk.epoch();
    if let Some(flip) = flip {
        let base = (MAX_EPOCH - AFTER as u32 / 2) & !1;
        let target = base + ((before & 1) ^ flip as u32);
        mk.set_epoch_for_test(target).unwrap();
    }
    let jumped = mk.epoch();
    let last = *toks.last().unwrap();
    toks.extend(mk.decode_greedy(last, AFTER).unwrap());
    let logits = mk.feed(&[*toks.last().unwrap()]).unwrap();
    (toks, logits, [before, jumped, mk.epoch()])
}

#[test]
#[ignore = "needs a GPU"]
fn greedy_decoding_is_unchanged_across_the_tag_wrap() {
    let gpu = Gpu::new(0).expect("a GPU");
    let mut cfg = presets::by_name("smollm2-135m").unwrap();
    cfg.num_layers = 4;
    cfg.vocab_size = 1000;
    let w = random_weights(&cfg, 21);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let sched = schedule_for(&cfg, &gpu, 64, None).unwrap();
    let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 64).unwrap();

    mk.set_tokens_per_launch(1);
    let (want, want_logits, _) = run(&mut mk, None);
    // One launch per step, and generations (many steps a launch), which end at the wrap and
    // restart the epoch in the next launch.
    for (per_launch, flip) in [
        (1, true),
        (1, false),
        (usize::MAX, true),
        (usize::MAX, false),
    ] {
        mk.set_tokens_per_launch(per_launch);
        let (got, logits, [before, jumped, end]) = run(&mut mk, Some(flip));
        let err = rel_l2(&logits, &want_logits);
        println!(
            "{per_launch} steps a launch: epoch {before} -> {jumped} (parity {}), {end} at the end; tokens {got:?}; logits after: rel L2 {err:.2e} against the run without a wrap",
            if flip { "changed" } else { "kept" },
        );
        assert_eq!((before ^ jumped) & 1 == 1, flip);
        assert!(jumped > MAX_EPOCH - AFTER as u32, "{jumped}");
        assert!(end < AFTER as u32, "the epoch did not wrap: {end}");
        assert_eq!(
            got, want,
            "greedy tokens differ across the wrap (parity {flip})"
        );
        // The same kernel on the same inputs in the same order: no arithmetic differs.
        assert!(err <= 1e-6, "logits differ after the wrap: rel L2 {err}");
    }
}
