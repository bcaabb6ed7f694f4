#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel with
# its ring planned for the buckets' attention instructions (MEGAINFER_MK_RING_BY_BUCKETS=1, the
# default; it made Qwen2.5-7B's 8 pages 12 at short contexts until 99ce411, since which no
# preset's plan depends on it) against the whole groups' plan
# (=0), alternating in one call, ROUNDS rounds (default 2), on each preset of PRESETS (default
# Qwen2.5-7B): scripts/bench-granularity.sh's rows with those two variants.
# Run as: TESTS=" " EXTRA="bash scripts/bench-ring-by-buckets.sh" bash scripts/gpu-check.sh
# (its correctness: TESTS=bundle/tests/gpu_megakernel-* TEST_FILTER=over_one_round bash
# scripts/gpu-check.sh runs the teacher-forced test whose 3584-wide model has Qwen2.5-7B's
# groups of 7 query heads of 128, 12 pages with the default plan.)
CASES=$(for P in ${PRESETS:-qwen2.5-7b}; do
  echo "$P MEGAINFER_MK_RING_BY_BUCKETS=0"
  echo "$P MEGAINFER_MK_RING_BY_BUCKETS=1"
done) ROUNDS=${ROUNDS:-2} bash "$(dirname "$0")/bench-granularity.sh"
