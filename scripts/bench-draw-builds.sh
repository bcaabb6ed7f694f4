#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): the megakernel's
# sampled steps on its default draw, several builds (BINS, default: bundle/megainfer-old and
# bundle/megainfer) and compile variants of this one (VARIANTS="LABEL:DEFINES ...", each run as
# bundle/megainfer with MEGAINFER_MK_DEFINES=DEFINES) alternating in one call, ROUNDS rounds
# (default 2), for each rule of RULES (";"-separated; default: greedy, T 0.8 top-p 0.95 and
# T 0.8 min-p 0.05), on each preset of PRESETS (default: SmolLM2; 32-token prompt, 128 new
# tokens, --reps 3) or, with DRAW_MODEL=default, on the default model (`bench -m` with bench's
# 37-token prompt, --reps 5; scripts/gpu-check.sh joins its parts). BENCH_ARGS adds `bench`
# options to every run (e.g. `--max-context 32768`: a short run in the buckets `run` sets up);
# PATHS (default megakernel) the paths each run times, e.g. `megakernel,graph-pdl`, whose rows
# then come with bench's count of the megakernel's tokens identical to the other path's (for
# builds that change the kernel's layout, e.g. `MEGAINFER_PAGE_BYTES`'s, docs/gpu-machine.md).
# Run as: TESTS=" " BINS="…" EXTRA="bash scripts/bench-draw-builds.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
BINS=${BINS:-bundle/megainfer-old bundle/megainfer}
IFS=';' read -ra RS <<< "${RULES:-greedy;--temperature 0.8 --top-p 0.95;--temperature 0.8 --min-p 0.05}"
if [ "${DRAW_MODEL:-}" = default ]; then
  CASES=default
else
  CASES=${PRESETS:-smollm2-135m}
fi
for C in $CASES; do
  if [ "$C" = default ]; then
    ARGS="-m $MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf --prompt-len 37 --reps 5"
  else
    ARGS="--preset $C --reps 3"
  fi
  ARGS="$ARGS ${BENCH_ARGS:-}"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for rule in "${RS[@]}"; do
      [ "$rule" = greedy ] && rule=""
      for N in $BINS; do
        r "$C $(basename $N) [${rule:-greedy}]" $N bench $ARGS --paths "${PATHS:-megakernel}" $rule
      done
      for V in ${VARIANTS:-}; do
        r "$C ${V%%:*} [${rule:-greedy}]" MEGAINFER_MK_DEFINES="${V#*:}" bundle/megainfer bench $ARGS --paths "${PATHS:-megakernel}" $rule
      done
    done
  done
done
rm -f $OUT/b.log
