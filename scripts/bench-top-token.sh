#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the draws decided by
# the top token alone (smp_top_dominates, kernels/sampling/select.cuh), an older build
# (bundle/megainfer-old) against this one (bundle/megainfer), alternating, two rounds, on each
# preset of PRESETS (default: SmolLM2 and Llama-1B); 32-token prompt, 128 new tokens; greedy and
# T 0.8 top-p 0.95 on the megakernel's default draw (inside the launch on SmolLM2, after it on
# Llama-1B) and on graph + PDL (the fused sampler); then once each: the megakernel's other
# draw, and min-p 0.05 (which the test leaves alone).
# Run as: TESTS=" " EXTRA="bash scripts/bench-top-token.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
TP="--temperature 0.8 --top-p 0.95"
for P in ${PRESETS:-smollm2-135m llama-3.2-1b}; do
  for round in 1 2; do
    for N in bundle/megainfer-old bundle/megainfer; do
      B="$N bench --preset $P --paths megakernel,graph-pdl --reps 3"
      r "$P $(basename $N) greedy" $B
      r "$P $(basename $N) top-p" $B $TP
    done
  done
  for N in bundle/megainfer-old bundle/megainfer; do
    B="$N bench --preset $P --paths megakernel --reps 3"
    r "$P $(basename $N) top-p in-launch" MEGAINFER_MK_DRAW_IN_LAUNCH=1 $B $TP
    r "$P $(basename $N) top-p after-launch" MEGAINFER_MK_DRAW_IN_LAUNCH=0 $B $TP
    r "$P $(basename $N) min-p 0.05" $B --temperature 0.8 --min-p 0.05
  done
done
rm -f $OUT/b.log
