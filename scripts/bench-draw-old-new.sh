#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel's
# sampled steps, an older build (bundle/megainfer-old) against this one in the same call,
# alternating, two rounds: greedy, the draw after each launch and the draw inside the launch
# (MEGAINFER_MK_DRAW_IN_LAUNCH=1), T 0.8 top-p 0.95 unless a row says otherwise, on each
# preset of PRESETS (default: SmolLM2 and Llama-1B); 32-token prompt, 128 new tokens.
# NEW_ENV="A=1;B=2 C=3": each entry adds a row a round of this build's draw inside the launch
# with those variables set (measuring variants, e.g. MEGAINFER_MK_DEFINES=-DMK_SMP_EXCHANGE=1).
# Run as: TESTS=" " EXTRA="bash scripts/bench-draw-old-new.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
TP="--temperature 0.8 --top-p 0.95"
IL="MEGAINFER_MK_DRAW_IN_LAUNCH=1"
for P in ${PRESETS:-smollm2-135m llama-3.2-1b}; do
  for round in 1 2; do
    for N in bundle/megainfer-old bundle/megainfer; do
      B="$N bench --preset $P --paths megakernel --reps 3"
      r "$P $(basename $N) greedy" $B
      r "$P $(basename $N) top-p after-launch" $B $TP
      r "$P $(basename $N) top-p in-launch" $IL $B $TP
    done
    IFS=';' read -ra VARS <<< "${NEW_ENV:-}"
    for V in "${VARS[@]}"; do
      [ -n "$V" ] && r "$P megainfer top-p in-launch $V" $IL $V bundle/megainfer bench --preset $P --paths megakernel --reps 3 $TP
    done
  done
  for N in bundle/megainfer-old bundle/megainfer; do
    B="$N bench --preset $P --paths megakernel --reps 3"
    r "$P $(basename $N) min-p 0.05 in-launch" $IL $B --temperature 0.8 --min-p 0.05
    r "$P $(basename $N) top-k 40 in-launch" $IL $B --temperature 0.8 --top-k 40
    r "$P $(basename $N) T 1 in-launch" $IL $B --temperature 1.0
  done
done
rm -f $OUT/b.log
