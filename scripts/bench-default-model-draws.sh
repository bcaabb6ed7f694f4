#!/usr/bin/env bash
# On the GPU machine with the default model joined (scripts/gpu-check.sh): an older build
# (bundle/megainfer-old) against this one (bundle/megainfer): greedy (two rounds), the draw
# after each launch and inside it (MEGAINFER_MK_DRAW_IN_LAUNCH=1), and `run --chat` tokens:
# old vs new after the launch, after vs inside the launch.
# Run as: TESTS=" " EXTRA="bash scripts/bench-default-model-draws.sh" bash scripts/gpu-check.sh
N=bundle/megainfer; O=bundle/megainfer-old; M=$MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
. "$(dirname "$0")/bench-rows.sh"
IL="MEGAINFER_MK_DRAW_IN_LAUNCH=1"
for round in 1 2; do
  r "default greedy old" $O bench -m $M --prompt-len 37 --reps 5 --paths megakernel
  r "default greedy new" $N bench -m $M --prompt-len 37 --reps 5 --paths megakernel
done
for rule in "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --min-p 0.05"; do
  for round in 1 2; do
    r "default [$rule] after-launch old" $O bench -m $M --prompt-len 37 --reps 5 --paths megakernel,graph-pdl $rule
    r "default [$rule] after-launch new" $N bench -m $M --prompt-len 37 --reps 5 --paths megakernel,graph-pdl $rule
  done
  r "default [$rule] in-launch old" $IL $O bench -m $M --prompt-len 37 --reps 5 --paths megakernel $rule
  r "default [$rule] in-launch new" $IL $N bench -m $M --prompt-len 37 --reps 5 --paths megakernel $rule
done
P="Write a short story about a lighthouse keeper who finds a message in a bottle."
for rule in "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --min-p 0.05" "--temperature 1.0 --top-p 0.9 --repeat-penalty 1.1" "--temperature 0.7 --top-k 40"; do
  for seed in 1 2; do
    $O run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/x.json 2>/dev/null
    $N run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/o.json 2>/dev/null
    env $IL $N run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/n.json 2>$OUT/n.err
    python3 scripts/same-tokens.py "run [$rule] seed $seed" old-after=$OUT/x.json new-after=$OUT/o.json \
      new-in-launch=$OUT/n.json || tail -3 $OUT/n.err
  done
done
rm -f $OUT/b.log $OUT/o.json $OUT/n.json $OUT/x.json
