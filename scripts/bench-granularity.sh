#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel under
# variants set by the environment, alternating in one call, ROUNDS rounds (default 1); made for
# the scheduler's granularity (src/gpu/paths.rs, `env_overrides`) against the cost model's
# choice, and any other MEGAINFER_* switch (scripts/bench-ring-by-buckets.sh). CASES: one case a
# line, a preset then the variables of a variant (none: the defaults, "cost model"), e.g.
#   CASES=$'llama-3.2-3b\nllama-3.2-3b MEGAINFER_MK_QKV_PAIRS=20'
# Each row is `bench --preset NAME --reps 3 --paths megakernel` (32-token prompt, 128 new
# tokens, greedy) and prints its ms/token and share of the read bandwidth.
# Run as: TESTS=" " CASES=... EXTRA="bash scripts/bench-granularity.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
for round in $(seq 1 "${ROUNDS:-1}"); do
  while read -r P VARS; do
    [ -n "$P" ] || continue
    # shellcheck disable=SC2086 # VARS is a list of NAME=VALUE words
    r "$P ${VARS:-cost model}" $VARS bundle/megainfer bench --preset "$P" --reps 3 --paths megakernel
  done <<< "$CASES"
done
rm -f $OUT/b.log
