#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the loader held to
# K tiles in flight until the token a step feeds is out (MEGAINFER_MK_DEFINES=-DMK_HOLD_NEXT=K,
# megakernel/loader.cuh), against none (K 0), alternating, two rounds: greedy (one launch a
# generation) and, unless SAMPLED=0, T 0.8 top-p 0.95 drawn inside the launch, on each preset
# of PRESETS (default: SmolLM2 and Llama-1B; NAME@TYPE adds --dtype TYPE) and each K of HOLDS
# (default: 2 4); 32-token prompt, 128 new tokens.
# Run as: TESTS=" " EXTRA="bash scripts/bench-hold-next.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
TP="--temperature 0.8 --top-p 0.95"
IL="MEGAINFER_MK_DRAW_IN_LAUNCH=1"
for PT in ${PRESETS:-smollm2-135m llama-3.2-1b}; do
  P=${PT%@*}
  DT=""
  [ "$PT" != "$P" ] && DT="--dtype ${PT#*@}"
  B="bundle/megainfer bench --preset $P $DT --paths megakernel --reps 3"
  for round in 1 2; do
    for K in 0 ${HOLDS:-2 4}; do
      D="MEGAINFER_MK_DEFINES=-DMK_HOLD_NEXT=$K"
      r "$PT hold $K greedy" $D $B
      [ "${SAMPLED:-1}" = 1 ] && r "$PT hold $K top-p in-launch" $D $IL $B $TP
    done
  done
done
rm -f $OUT/b.log
