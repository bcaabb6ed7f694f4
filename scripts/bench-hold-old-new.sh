#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): greedy generations
# (one launch each), an older build (bundle/megainfer-old) against this one, alternating, on
# each preset of PRESETS (default: Llama-3.1-8B and Qwen3-8B), ROUNDS rounds (default 1);
# 32-token prompt, 128 new tokens.
# Run as: TESTS=" " EXTRA="bash scripts/bench-hold-old-new.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
for P in ${PRESETS:-llama-3.1-8b qwen3-8b}; do
  for round in $(seq ${ROUNDS:-1}); do
    for N in bundle/megainfer-old bundle/megainfer; do
      r "$P $(basename $N) greedy" $N bench --preset $P --paths megakernel --reps 3
    done
  done
done
rm -f $OUT/b.log
