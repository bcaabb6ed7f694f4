#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the draw inside the
# launch (MEGAINFER_MK_DRAW_IN_LAUNCH=1), an older build (bundle/megainfer-old) against this one,
# alternating: on the SmolLM2 preset (32 + 128, T 0.8 top-p 0.95), and where the default model
# is joined, on it (37-token prompt + 128; top-p 0.95 and min-p 0.05, whose draws often search
# the whole vocabulary) with `run --chat` tokens after the launch against inside it.
# Run as: TESTS=" " EXTRA="bash scripts/bench-in-launch-search.sh" bash scripts/gpu-check.sh
N=bundle/megainfer; O=bundle/megainfer-old; M=$MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
. "$(dirname "$0")/bench-rows.sh"
IL="MEGAINFER_MK_DRAW_IN_LAUNCH=1"
if [ ! -f "$M" ]; then
  for B in $O $N; do
    r "smollm2 top-p in-launch $(basename $B)" $IL $B bench --preset smollm2-135m --paths megakernel --reps 3 --temperature 0.8 --top-p 0.95
  done
  exit 0
fi
for rule in "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --min-p 0.05"; do
  for B in $O $N; do
    r "default [$rule] in-launch $(basename $B)" $IL $B bench -m $M --prompt-len 37 --reps 3 --paths megakernel $rule
  done
done
P="Write a short story about a lighthouse keeper who finds a message in a bottle."
for rule in "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --min-p 0.05" "--temperature 1.0 --top-p 0.9 --repeat-penalty 1.1" "--temperature 0.7 --top-k 40"; do
  $N run -m $M --chat --json -n 128 -p "$P" $rule --seed 1 > $OUT/a.json 2>/dev/null
  env $IL $N run -m $M --chat --json -n 128 -p "$P" $rule --seed 1 > $OUT/b.json 2>$OUT/b.err
  python3 scripts/same-tokens.py "run [$rule] seed 1" after=$OUT/a.json in-launch=$OUT/b.json || tail -3 $OUT/b.err
done
rm -f $OUT/b.log $OUT/a.json $OUT/b.json
