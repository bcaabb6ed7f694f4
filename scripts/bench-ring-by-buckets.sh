#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel with
# its ring planned for the buckets' attention instructions (MEGAINFER_MK_RING_BY_BUCKETS=1, the
# default: Qwen2.5-7B's 8 pages become 12 at short contexts) against the whole groups' plan
# (=0), alternating in one call, ROUNDS rounds (default 2), on each preset of PRESETS (default
# Qwen2.5-7B; `bench --preset NAME --reps 3 --paths megakernel`, 32-token prompt, 128 new
# tokens, greedy).
# Run as: TESTS=" " EXTRA="bash scripts/bench-ring-by-buckets.sh" bash scripts/gpu-check.sh
# (its correctness: TESTS=bundle/tests/gpu_megakernel-* TEST_FILTER=over_one_round bash
# scripts/gpu-check.sh runs the teacher-forced test whose 3584-wide model has Qwen2.5-7B's
# groups of 7 query heads of 128, 12 pages with the default plan.)
. "$(dirname "$0")/bench-rows.sh"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for P in ${PRESETS:-qwen2.5-7b}; do
    B="bench --preset $P --reps 3 --paths megakernel"
    r "$P whole groups' plan" MEGAINFER_MK_RING_BY_BUCKETS=0 bundle/megainfer $B
    r "$P ring by buckets" MEGAINFER_MK_RING_BY_BUCKETS=1 bundle/megainfer $B
  done
done
rm -f $OUT/b.log
