#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel's draw
# inside the launch against the draw after it, on the SmolLM2 and Llama-1B presets, with the
# sampled variant's greedy steps (MEGAINFER_MK_GREEDY_ON_SAMPLED=1) and the in-launch draws' search counts.
# Run as: TESTS=" " EXTRA="bash scripts/bench-draw-in-launch.sh" bash scripts/gpu-check.sh
N=bundle/megainfer
. "$(dirname "$0")/bench-rows.sh"
TP="--temperature 0.8 --top-p 0.95"
IL="MEGAINFER_MK_DRAW_IN_LAUNCH=1"
for P in smollm2-135m llama-3.2-1b; do
  for round in 1 2; do
    r "$P greedy" $N bench --preset $P --paths megakernel --reps 3
    r "$P top-p after-launch" $N bench --preset $P --paths megakernel --reps 3 $TP
    r "$P top-p in-launch" $IL $N bench --preset $P --paths megakernel --reps 3 $TP
  done
  r "$P greedy on sampled variant" MEGAINFER_MK_GREEDY_ON_SAMPLED=1 $N bench --preset $P --paths megakernel --reps 3
  r "$P T1 in-launch" $IL $N bench --preset $P --paths megakernel --reps 3 --temperature 1.0
  r "$P top-k40 in-launch" $IL $N bench --preset $P --paths megakernel --reps 3 --temperature 0.8 --top-k 40
  r "$P top-k40 after-launch" $N bench --preset $P --paths megakernel --reps 3 --temperature 0.8 --top-k 40
  r "$P min-p in-launch" $IL $N bench --preset $P --paths megakernel --reps 3 --temperature 0.8 --min-p 0.05
done
rm -f $OUT/b.log
