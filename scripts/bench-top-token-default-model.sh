#!/usr/bin/env bash
# On the GPU machine with the default model joined (scripts/gpu-check.sh): the draws decided by
# the top token alone (smp_top_dominates) on trained logits, an older build
# (bundle/megainfer-old) against this one (bundle/megainfer): greedy, and T 0.8 top-p 0.95 on
# the megakernel's default draw (inside the launch on this vocabulary) and graph + PDL, two
# rounds; then `run --chat` tokens old against new, and new inside against after the launch.
# Run as: TESTS=" " EXTRA="bash scripts/bench-top-token-default-model.sh" bash scripts/gpu-check.sh
N=bundle/megainfer; O=bundle/megainfer-old; M=$MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
. "$(dirname "$0")/bench-rows.sh"
r "default greedy old" $O bench -m $M --prompt-len 37 --reps 5 --paths megakernel
r "default greedy new" $N bench -m $M --prompt-len 37 --reps 5 --paths megakernel
for round in 1 2; do
  for B in $O $N; do
    r "default top-p 0.95 $(basename $B)" $B bench -m $M --prompt-len 37 --reps 5 --paths megakernel,graph-pdl \
      --temperature 0.8 --top-p 0.95
  done
done
P="Write a short story about a lighthouse keeper who finds a message in a bottle."
for rule in "--temperature 0.8 --top-p 0.95" "--temperature 1.0 --top-p 0.9 --repeat-penalty 1.1" "--temperature 0.8 --top-p 0.5"; do
  for seed in 1 2; do
    $O run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/x.json 2>/dev/null
    $N run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/o.json 2>$OUT/n.err
    env MEGAINFER_MK_DRAW_IN_LAUNCH=0 $N run -m $M --chat --json -n 128 -p "$P" $rule --seed $seed > $OUT/n.json 2>>$OUT/n.err
    python3 scripts/same-tokens.py "run [$rule] seed $seed" old=$OUT/x.json new=$OUT/o.json \
      new-after-launch=$OUT/n.json || tail -3 $OUT/n.err
  done
done
rm -f $OUT/b.log $OUT/o.json $OUT/n.json $OUT/x.json
