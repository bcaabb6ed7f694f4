#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): which draw a
# sampled megakernel step takes by default (inside the launch for vocabularies up to 65,536
# tokens, after it for larger ones) and with MEGAINFER_MK_DRAW_IN_LAUNCH set either way, T 0.8
# top-p 0.95, on SmolLM2 and Llama-1B; 32-token prompt, 128 new tokens. A row that printed
# "searched" drew inside the launch.
# Run as: TESTS=" " EXTRA="bash scripts/bench-draw-default.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
TP="--temperature 0.8 --top-p 0.95"
for P in smollm2-135m llama-3.2-1b; do
  B="bundle/megainfer bench --preset $P --paths megakernel --reps 3"
  r "$P greedy" $B
  r "$P top-p default" $B $TP
  r "$P top-p MEGAINFER_MK_DRAW_IN_LAUNCH=1" MEGAINFER_MK_DRAW_IN_LAUNCH=1 $B $TP
  r "$P top-p MEGAINFER_MK_DRAW_IN_LAUNCH=0" MEGAINFER_MK_DRAW_IN_LAUNCH=0 $B $TP
  r "$P top-p default" $B $TP
done
rm -f $OUT/b.log
