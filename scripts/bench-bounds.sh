#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): what bounds the
# megakernel's step on each preset of PRESETS (default below): the default kernel, the same
# with no waits for inputs (`-DMK_NO_DEPS=1`: the chain of hops between SMs taken away) and
# with no dot products either (`-DMK_TILE_SKIP_DOT=1` beside it: the weights' ring and the
# tiles' loop alone). Garbage results in the two bounds, so one launch per token
# (`--tokens-per-launch 1`: a generation's hand-over of the token needs the SMs in step, which
# a kernel without waits does not keep). `bench --preset P --reps 3 --paths megakernel`, ROUNDS
# rounds (default 1); BENCH_ARGS adds bench options (e.g. "--prompt-len 8127 --gen 64": an 8K
# context). HOPS="QKV ATTN OPROJ UPGATE DOWN" (op names, runtime.cuh's OP_*) adds a row for each:
# only that instruction's waits skipped (`-DMK_NO_DEPS_OPS=(1<<OP_QKV)`: the hop into it), so
# the chain's cost splits by hop. EXCEPT="QKV ATTN OPROJ UPGATE DOWN" adds the converse: a row
# with no waits in any of a layer's instructions (the LM head and argmax keep theirs), then one
# for each op of EXCEPT where only that op's instructions wait (one hop a layer left). Other
# switches pass through the environment, e.g.
# MEGAINFER_MK_TILE_ROWS=3.
# Run as: TESTS=" " EXTRA="bash scripts/bench-bounds.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
for round in $(seq 1 "${ROUNDS:-1}"); do
  for P in ${PRESETS:-llama-3.2-1b smollm2-135m qwen3-1.7b qwen3-4b llama-3.2-3b llama-3.1-8b}; do
    # shellcheck disable=SC2206 # BENCH_ARGS is a list of words
    args=(bench --preset "$P" --reps 3 --paths megakernel --tokens-per-launch 1 ${BENCH_ARGS:-})
    r "$P default" bundle/megainfer "${args[@]}"
    r "$P no-deps" MEGAINFER_MK_DEFINES="-DMK_NO_DEPS=1" bundle/megainfer "${args[@]}"
    r "$P no-deps no-dots" MEGAINFER_MK_DEFINES="-DMK_NO_DEPS=1 -DMK_TILE_SKIP_DOT=1" bundle/megainfer "${args[@]}"
    for op in ${HOPS:-}; do
      r "$P no waits in $op" MEGAINFER_MK_DEFINES="-DMK_NO_DEPS_OPS=(1<<OP_$op)" bundle/megainfer "${args[@]}"
    done
    if [ -n "${EXCEPT:-}" ]; then
      layer="(1<<OP_QKV)|(1<<OP_ATTN)|(1<<OP_ATTN_REDUCE)|(1<<OP_OPROJ)|(1<<OP_UPGATE)|(1<<OP_DOWN)"
      r "$P no waits in a layer" MEGAINFER_MK_DEFINES="-DMK_NO_DEPS_OPS=($layer)" bundle/megainfer "${args[@]}"
      for op in $EXCEPT; do
        r "$P waits in $op alone" MEGAINFER_MK_DEFINES="-DMK_NO_DEPS_OPS=(($layer)&~(1<<OP_$op))" bundle/megainfer \
          "${args[@]}"
      done
    fi
  done
done
rm -f "$OUT/b.log"
