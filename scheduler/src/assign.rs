//! Spreads each stage over the SMs so that every SM carries about the same cost.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

/// For instructions grouped into consecutive `stages` (ranges of the global order) with
/// `cost[i]` each, the SM of every instruction: per stage, longest processing time first, each
/// onto the SM with the least cost in this stage, ties to the SM with the least cost so far
/// (so that stages smaller than the GPU do not all land on the same SMs), then the lowest SM.
pub(crate) fn balance(stages: &[Range<usize>], cost: &[u64], sms: usize) -> Vec<u32> {
    let mut sm_of = vec![0u32; cost.len()];
    let mut total = vec![0u64; sms];
    for stage in stages {
        let mut order: Vec<usize> = stage.clone().collect();
        order.sort_by_key(|&i| Reverse(cost[i]));
        let mut heap: BinaryHeap<Reverse<(u64, u64, usize)>> =
            (0..sms).map(|s| Reverse((0, total[s], s))).collect();
        for i in order {
            let Reverse((load, _, s)) = heap.pop().expect("at least one SM");
            sm_of[i] = s as u32;
            total[s] += cost[i];
            heap.push(Reverse((load + cost[i], total[s], s)));
        }
    }
    sm_of
}
