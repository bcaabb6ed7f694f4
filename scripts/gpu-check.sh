#!/usr/bin/env bash
# Runs every GPU check in one run on a GPU machine; builds nothing. Expects in bundle/:
#   megainfer, tests/<test binaries> (either may be .xz), and optionally model.gguf.part-{a,b}
#   (here or in bundle-model/, so the parts can arrive in separate calls): the default model
#   split in two (98 MB is over one call's transfer limit). A part found in bundle/ is moved to
#   /root/models, and the model is joined there once both parts have arrived.
# GPU tests are #[ignore = "needs a GPU"]: every binary runs with --include-ignored (chat_cli
# with --ignored: see below), so the table's "ignored" column must read 0 (docs/gpu-machine.md).
# Prints a short table last; full logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/models
export MEGAINFER_CACHE=/root/mcache
mkdir -p "$MEGAINFER_CACHE"
MODEL="$MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
# SAVE_CACHE=1: the newest 80 compiled kernels to $OUT/0-mcache.tar.xz (named to sort first:
# only 8 files come back from a call), for bundle/mcache.tar.xz in later calls.
save_cache() {
  if [ "${SAVE_CACHE:-0}" = 1 ] && [ -d "$MEGAINFER_CACHE/kernels" ]; then
    (cd "$MEGAINFER_CACHE/kernels" && ls -t -- *.cubin 2>/dev/null | head -80 | tar -cJf "$OUT/0-mcache.tar.xz" -T -)
    echo "kernel cache saved: $(du -h "$OUT/0-mcache.tar.xz" | cut -f1)"
  fi
}
# DEADLINE=SECONDS: everything below runs in a child stopped after that long (with whatever it
# was running: GNU timeout signals the child's whole process group), then SAVE_CACHE still
# happens; the rows printed so far and the logs in $OUT stay. For a machine that gives a
# command a fixed time: a DEADLINE some 30 s under it keeps the compiled kernels of a run that
# overran.
if [ -n "${DEADLINE:-}" ] && [ -z "${GPU_CHECK_CHILD:-}" ]; then
  GPU_CHECK_CHILD=1 timeout -k 5 "$DEADLINE" bash "$0" "$@"
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "DEADLINE: the checks were stopped after $DEADLINE s"
  save_cache
  exit "$rc"
fi
# Compiled kernels carried from an earlier call (SAVE_CACHE=1 below): NVRTC takes 10-20 s per
# megakernel variant and preset on a fresh machine. The cache is keyed by source, options and
# NVRTC version (src/gpu/compile.rs), so a stale entry is never used, only ignored.
if [ -f bundle/mcache.tar.xz ]; then
  mkdir -p "$MEGAINFER_CACHE/kernels"
  tar -xJf bundle/mcache.tar.xz -C "$MEGAINFER_CACHE/kernels" \
    && echo "kernel cache: $(ls "$MEGAINFER_CACHE/kernels" | wc -l) CUBINs carried"
fi
for part in a b; do
  for dir in bundle bundle-model; do
    [ -f $dir/model.gguf.part-$part ] && cp $dir/model.gguf.part-$part /root/models/
  done
done
# Binaries may arrive xz-compressed (a call's transfer is limited); unpack them in place.
for f in bundle/*.xz bundle/tests/*.xz; do [ -f "$f" ] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
if [ ! -f "$MODEL" ] && [ -f /root/models/model.gguf.part-a ] && [ -f /root/models/model.gguf.part-b ]; then
  cat /root/models/model.gguf.part-a /root/models/model.gguf.part-b > "$MODEL"
fi
[ -f "$MODEL" ] && echo "default model present: $(sha256sum "$MODEL" | cut -c1-16)" || echo "default model NOT present"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader

declare -a rows
for t in ${TESTS:-bundle/tests/*}; do
  name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
  start=$(date +%s.%N)
  # chat_cli's other tests run the CLI binary at the path it was built at (CARGO_BIN_EXE), which
  # exists on the development machine only: CI runs them; here its GPU tests alone (--ignored).
  scope=--include-ignored
  [ "$name" = chat_cli ] && scope=--ignored
  timeout "${TEST_TIMEOUT:-400}" "$t" $scope --test-threads=1 --nocapture ${TEST_FILTER:-} \
    > "$OUT/$name.log" 2>&1
  rc=$?
  secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  summary=$(grep -E "^test result:" "$OUT/$name.log" | tail -1)
  ignored=$(sed -nE 's/^test result:.* ([0-9]+) ignored.*/\1/p' "$OUT/$name.log" | tail -1)
  rows+=("$(printf '%-28s rc=%-3s %6ss ignored=%s %s' "$name" "$rc" "$secs" "${ignored:-?}" "$summary")")
  # Each test's row as it finishes too: a run cut short still shows the tests it completed.
  echo "finished: ${rows[-1]}"
  grep -E "rel L2|tok/s|ms/token|near-tie|FAILED|panicked|error" "$OUT/$name.log" | tail -40
done
# EXTRA: a command run after the tests; its output is printed and kept in $OUT/0-extra.log
# (named to sort first, beside the kernel cache: only 8 files come back from a call).
if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA" 2>&1 | tee "$OUT/0-extra.log"; fi
echo
echo "=== GPU check summary ==="
printf '%s\n' "${rows[@]}"

# ==== optional reliability checks (off unless asked): SANITIZE=1, SOAK=1 ====
# SANITIZE=1: compute-sanitizer memcheck, racecheck and synccheck on `megainfer run` with the
#   megakernel and the graph path, a few tokens of the default model (SANITIZE_TOKENS, default 4;
#   SANITIZE_TOOLS / SANITIZE_PATHS to narrow; SANITIZE_PROMPT, SANITIZE_ARGS for the run: a
#   one-token prompt keeps cuBLAS, whose kernels racecheck flags, out of the run).
#   Wants "ERROR SUMMARY: 0 errors" on every line.
# SOAK=1: `megainfer soak`: SOAK_TOKENS (default 100000) greedy tokens, megakernel vs graph,
#   restarting from a fresh prompt whenever the context fills. Wants "0 mismatches".
MEGAINFER_BIN=${MEGAINFER_BIN:-bundle/megainfer}
if [ "${SANITIZE:-0}" = 1 ]; then
  CS=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
  echo
  echo "=== compute-sanitizer ==="
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    for path in ${SANITIZE_PATHS:-megakernel graph}; do
      log="$OUT/sanitize-$tool-$path.log"
      start=$(date +%s)
      # The tools slow the megakernel far past its 2 s stall limit; racecheck gets mk_instr as
      # atomics (MK_INSTR_ATOMIC, runtime.cuh), every reader's own page release (MK_LANE_ARRIVALS,
      # pipeline.cuh) and line numbers in its reports.
      defines=""; [ "$tool" = racecheck ] && defines="-lineinfo -DMK_INSTR_ATOMIC=1 -DMK_LANE_ARRIVALS=1"
      MEGAINFER_WAIT_TIMEOUT_MS=${SANITIZE_WAIT_MS:-600000} MEGAINFER_MK_DEFINES="$defines" \
      timeout "${SANITIZE_TIMEOUT:-500}" "$CS" --tool "$tool" --error-exitcode 99 \
        "$MEGAINFER_BIN" run --device cuda --path "$path" -n "${SANITIZE_TOKENS:-4}" \
        -p "${SANITIZE_PROMPT:-The capital of France is}" ${SANITIZE_ARGS:-} > "$log" 2>&1
      rc=$?
      printf '%-10s %-11s rc=%-3s %5ss %s\n' "$tool" "$path" "$rc" "$(( $(date +%s) - start ))" \
        "$(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
      [ "$rc" = 0 ] || tail -20 "$log"
    done
  done
fi
if [ "${SOAK:-0}" = 1 ]; then
  echo
  echo "=== soak ==="
  timeout "${SOAK_TIMEOUT:-580}" "$MEGAINFER_BIN" soak --tokens "${SOAK_TOKENS:-100000}" \
    --against "${SOAK_AGAINST:-graph}" > "$OUT/soak.log" 2>&1
  echo "soak rc=$?"
  grep -E "differ|mismatches|error" "$OUT/soak.log" | tail -15
fi
# ==== end of optional reliability checks ====

# ==== optional benchmarks (off unless asked): BENCH=1 ====
# Decode speed of this build against OLD_BIN (an earlier build, if given), alternating twice per
# preset; batched prefill's time to first token on the Llama-3.2-1B shape at 1, 32, 1K, 8K and
# 32K prompt tokens; the default model's 37-token prompt; greedy against sampled decoding; and,
# with PEERS=1, scripts/peers.py (torch) at the same lengths. Logs go to $OUT/bench-*.log.
# BENCH=long (not in BENCH=1): 64 new tokens after a prompt filling the context to 8K, 32K and
# (LONG_128K=1) 128K on the Llama-3.2-1B shape and to 8K on SmolLM2, megakernel (profiled) and
# graph, with the (weights + KV) floor; LONG_LENS overrides the Llama lengths.
# BENCH=qwen (not in BENCH=1): the Qwen3-0.6B and Qwen2.5-0.5B shapes on every path.
# BENCH=parts (not in BENCH=1): the megakernel's split-KV parts, OLD_BIN against this build on
# PARTS_CASES, and forced part counts (PARTS_SWEEP); see the section below.
# BENCH=presets (not in BENCH=1): every preset on the megakernel, graph + PDL and graph
#   (PRESETS narrows them; e.g. PRESETS="llama-3.2-1b@q4_0 llama-3.2-3b@q8_0" for quantised
#   weights, see preset_args).
# BENCH=defines (not in BENCH=1): megakernel compile variants (DEFINES, ';'-separated
# MEGAINFER_MK_DEFINES values) on DEFINES_CASES (PRESET[@DTYPE]:PROMPT_LEN ...).
# BENCH=timeline (not in BENCH=1): a profiled step's per-instruction table and a layer's
#   critical path (scripts/timeline.py) for each preset of TIMELINE_PRESETS, after a prompt of
#   TIMELINE_PROMPT tokens (default 32); TIMELINE_FLAGS adds timeline.py flags (--prep, --tiles);
#   LOADER_RATE="HIDDEN INTERMEDIATE [HEAD_DIM CONTEXT]" adds scripts/loader-rate.py's table
#   (one preset's sizes). The CSV comes back gzipped.
# BENCH=run (not in BENCH=1): `megainfer run` on the default model, OLD_BIN against this build.
# BENCH=chat (not in BENCH=1): `megainfer chat -v` turns on the default model, OLD_BIN too.
# BENCH=gen (not in BENCH=1): one launch per token against one per generation, OLD_BIN too.
# BENCH=mixed (not in BENCH=1): layers of different formats (bench --q4-k-m-mix; OLD_BIN's too) on
#   MIXED_PRESETS (default llama-3.2-1b) with MIXED_DTYPE (default q4_1): uniform, as stored,
#   and with its Q6_K matrices widened to bf16 (--q6-k-widened).
# BENCH=mv (not in BENCH=1): the graph paths' mat-vec geometries in the step: for each preset
#   of MV_PRESETS (default llama-3.2-1b), `bench --paths graph-pdl,graph --reps 3` with the
#   chosen geometries, then with each setting of MV_SWEEP (space-separated
#   MEGAINFER_BASELINE_MV values, e.g. "qkv=r2u8:1:2 gu=r2u4d:1:2,down=r2u8d:1:1"), OLD_BIN's
#   choices first when given.
# ';'-separated lists (BL_DEFINES, BL_ENV, MK_ENV, DEFINES, AB_FUSION, AB_ENV, SAMPLED_ENV, ...): bash's
#   `read -a` drops an empty last entry, so an empty entry (the default) goes first or between
#   two others: ";X" runs the default and X, "X;" runs X alone.
# BENCH=bldefines (not in BENCH=1): graph-path kernel variants of this build: each entry of
#   BL_DEFINES (';'-separated MEGAINFER_BASELINE_DEFINES values, an empty entry is the default
#   build, e.g. ";-DQG_UNROLL=2") on each preset of BL_PRESETS (default llama-3.2-1b),
#   `bench --paths graph-pdl,graph --reps 3`, BL_ROUNDS rounds (default 2).
# BENCH=blenv (not in BENCH=1): as bldefines, with BL_ENV's ';'-separated entries (each a list
#   of NAME=VALUE words, e.g. ";MEGAINFER_BASELINE_PREFETCH=32768:131072") set in the
#   environment instead; OLD_BIN (if given) runs first in each round with none.
# BENCH=mkenv (not in BENCH=1): as defines, with MK_ENV's ';'-separated entries (each a list of
#   NAME=VALUE words, e.g. ";MEGAINFER_MK_QKV_PIECES=264") set in the environment, on each
#   PRESET:PROMPT of MK_ENV_CASES, MK_ROUNDS rounds (default 2); MK_BENCH_ARGS adds bench
#   options to every run (e.g. "--max-context 8192": the context buckets `run` cuts).
# BENCH=draw (not in BENCH=1): the megakernel's sampled draw after the launch (the default)
#   against inside it (MEGAINFER_MK_DRAW_IN_LAUNCH=1, one launch per token and per generation),
#   greedy for reference, OLD_BIN too; T 0.8, top-p 0.95 on SmolLM2 and Llama-1B.
# BENCH=sampled (not in BENCH=1): greedy and sampled (T 0.8, top-p 0.95) decoding, OLD_BIN and
#   this build alternating, SAMPLED_ROUNDS rounds (default 2) of SAMPLED_PRESETS (default
#   smollm2-135m llama-3.2-1b) on SAMPLED_PATHS (default megakernel); SAMPLED_ENV adds sampled
#   rows of this build with each of its ';'-separated entries (NAME=VALUE words) set, e.g.
#   SAMPLED_ENV="MEGAINFER_SAMPLER_DEFINES=-DNAME=VALUE".
# BENCH=rules (not in BENCH=1): the default model (real logits), greedy, T 0.8 top-p 0.95 and T
#   0.8 min-p 0.05 (`bench --prompt-len 37 --reps 5 --paths megakernel,graph-pdl [RULE]`),
#   OLD_BIN (if given) and this build, RULES_ROUNDS rounds (default 2).
# BENCH=smpprof (not in BENCH=1): the fused sampler's phases: bundle/tests/gpu_sampler_bench-*
#   with MEGAINFER_SAMPLER_DEFINES=-DSMP_PROF=1, its printed draws summarised (median ns after
#   the first CTA's start, per test case, CTA count and attempt outcome) by
#   scripts/smp-prof.py.
# AB_PATHS (default megakernel) and LONG_PATHS (default megakernel,graph) pick the paths;
# AB_PRESETS, AB_ROUNDS and AB_FUSION are described at the loop.
# BENCH=1 runs ab, prefill, default and sampling; BENCH=ab,prefill,default,sampling,long,qwen picks.
bench_on() { [ "${BENCH:-0}" = 1 ] || [[ ",${BENCH:-}," == *",$1,"* ]]; }
if [ "${BENCH:-0}" != 0 ]; then
  echo
  echo "=== benchmarks ==="
  row() { grep -E "^\| *$2 " "$1" | head -1; }
  # BIN PRESET LOG [NAME=VALUE ...]: `bench --paths graph-pdl,graph --reps 3` with those set in
  # the environment, into LOG; prints "graph-pdl MS graph MS".
  graph_bench() {
    local bin=$1 preset=$2 log=$3
    shift 3
    env "$@" "$bin" bench --preset "$preset" --paths graph-pdl,graph --reps 3 > "$log" 2>&1
    echo "graph-pdl $(row "$log" graph-pdl | cut -d'|' -f3) graph $(row "$log" graph | cut -d'|' -f3)"
  }
  # PRESET PROMPT LOG [NAME=VALUE ...]: this build's megakernel, 64 new tokens, with those set
  # in the environment, into LOG; prints its row.
  mk_bench() {
    local preset=$1 len=$2 log=$3
    shift 3
    # shellcheck disable=SC2046,SC2086 # preset_args and MK_BENCH_ARGS are lists of words
    env "$@" "$MEGAINFER_BIN" bench $(preset_args "$preset") --prompt-len "$len" --gen 64 --reps 2 \
      --paths megakernel ${MK_BENCH_ARGS:-} > "$log" 2>&1
    row "$log" megakernel
  }
  # LABEL ROUNDS CASES ENTRIES KIND AS [OLD]: ROUNDS rounds of every case of CASES by every
  # ';'-separated entry of ENTRIES (an empty entry: nothing set), set in the environment as
  # NAME=VALUE words (AS=words) or as the value of the variable AS. KIND mk: the megakernel
  # (mk_bench), a case PRESET:PROMPT, a log per round; graph: graph + PDL and graph
  # (graph_bench), a case a preset, one log a case (the last round's), and with OLD=old
  # OLD_BIN's run (if given) first in each round. Logs are named by the entry's index (v0 is
  # the first): a file name holding '=' or spaces may not come back from the GPU machine.
  sweep() {
    local label=$1 rounds=$2 cases=$3 kind=$5 as=$6 old=${7:-} round spec i v log res
    local -a entries env
    IFS=';' read -r -a entries <<< "$4"
    for round in $(seq "$rounds"); do
      for spec in $cases; do
        if [ "$old" = old ] && [ -n "${OLD_BIN:-}" ]; then
          echo "$label $spec [OLD_BIN] round $round: $(graph_bench "$OLD_BIN" "$spec" "$OUT/bench-$label-$spec-old.log")"
        fi
        for i in "${!entries[@]}"; do
          v=${entries[$i]}
          if [ "$as" = words ]; then read -r -a env <<< "$v"; else env=("$as=$v"); fi
          log="$OUT/bench-$label-${spec//[@:]/-}-v$i"
          if [ "$kind" = mk ]; then res=$(mk_bench "${spec%%:*}" "${spec##*:}" "$log-$round.log" "${env[@]}")
          else res=$(graph_bench "$MEGAINFER_BIN" "$spec" "$log.log" "${env[@]}"); fi
          echo "$label ${spec/:/ } [${v:-default}] round $round: $res"
        done
      done
    done
  }
  # A preset of AB_PRESETS, PRESETS or TIMELINE_PRESETS may name the weights' storage after an
  # '@' (llama-3.2-1b@q4_0: the random weights quantised, `bench --dtype q4_0`).
  preset_args() { if [[ "$1" == *@* ]]; then echo "--preset ${1%@*} --dtype ${1#*@}"; else echo "--preset $1"; fi; }
  AB_PATHS=${AB_PATHS:-megakernel}
  # AB_PRESETS picks the presets, AB_ROUNDS the rounds (default 2); AB_FUSION (';'-separated
  # MEGAINFER_BASELINE_FUSION values) adds this build with those graph-path fusions to each round,
  # and AB_ENV (';'-separated lists of NAME=VALUE words, e.g. "MEGAINFER_MK_TILE_BALANCE=0")
  # this build with each list set in its environment.
  IFS=';' read -r -a ab_fusions <<< "${AB_FUSION:-}"
  IFS=';' read -r -a ab_envs <<< "${AB_ENV:-}"
  for preset in ${AB_PRESETS:-llama-3.2-1b smollm2-135m}; do
    bench_on ab || continue
    for i in $(seq "${AB_ROUNDS:-2}"); do
      for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
        log="$OUT/bench-ab-${preset/@/-}-$(basename "$bin")-$i.log"
        # shellcheck disable=SC2046 # preset_args is two or four words
        "$bin" bench $(preset_args "$preset") --paths "${AB_PATHS:-megakernel}" --reps 5 > "$log" 2>&1
        for p in ${AB_PATHS//,/ }; do
          echo "$preset $(basename "$bin") run $i: $(row "$log" "$p")"
        done
      done
      for j in "${!ab_envs[@]}"; do
        [ -n "${ab_envs[$j]}" ] || continue
        read -r -a words <<< "${ab_envs[$j]}"
        log="$OUT/bench-ab-${preset/@/-}-env$j-$i.log"
        # shellcheck disable=SC2046
        env "${words[@]}" "$MEGAINFER_BIN" bench $(preset_args "$preset") \
          --paths "${AB_PATHS:-megakernel}" --reps 5 > "$log" 2>&1
        for p in ${AB_PATHS//,/ }; do
          echo "$preset [${ab_envs[$j]}] run $i: $(row "$log" "$p")"
        done
      done
      for j in "${!ab_fusions[@]}"; do
        log="$OUT/bench-ab-${preset/@/-}-fusion$j-$i.log"
        # shellcheck disable=SC2046
        MEGAINFER_BASELINE_FUSION="${ab_fusions[$j]}" "$MEGAINFER_BIN" bench $(preset_args "$preset") \
          --paths "${AB_PATHS:-megakernel}" --reps 5 > "$log" 2>&1
        for p in ${AB_PATHS//,/ }; do
          echo "$preset fusion ${ab_fusions[$j]} run $i: $(row "$log" "$p")"
        done
      done
    done
  done
  for len in 1 32 1024 8192 32768; do
    bench_on prefill || continue
    log="$OUT/bench-prefill-$len.log"
    "$MEGAINFER_BIN" bench --preset llama-3.2-1b --prompt-len "$len" --gen 16 --reps 3 \
      --paths megakernel,graph > "$log" 2>&1
    echo "prefill $len: $(row "$log" megakernel)"
  done
  if bench_on default; then
    log="$OUT/bench-default-37.log"
    "$MEGAINFER_BIN" bench --prompt-len 37 --reps 5 > "$log" 2>&1
    echo "default model, prompt 37:"; grep -E "^\| " "$log"
  fi
  for preset in smollm2-135m llama-3.2-1b; do
    bench_on sampling || continue
    for s in "" "--temperature 0.8 --top-p 0.95"; do
      log="$OUT/bench-sampling-$preset-${s:+sampled}.log"
      "$MEGAINFER_BIN" bench --preset "$preset" --reps 5 $s > "$log" 2>&1
      echo "$preset ${s:-greedy}:"; grep -E "^\| (megakernel|graph)" "$log"
    done
  done
  if [[ ",${BENCH:-}," == *",long,"* ]]; then
    lens=${LONG_LENS:-8192 32768}
    [ "${LONG_128K:-0}" = 1 ] && lens="$lens 131072"
    for spec in $(for l in $lens; do echo "llama-3.2-1b:$l"; done) smollm2-135m:8192; do
      preset=${spec%%:*}; len=${spec##*:}
      log="$OUT/bench-long-$preset-$len.log"
      "$MEGAINFER_BIN" bench --preset "$preset" --prompt-len $((len - 65)) --gen 64 --reps 3 \
        --paths "${LONG_PATHS:-megakernel,graph}" --profile > "$log" 2>&1
      echo "$preset context $len: $(grep -E '^device' "$log" | grep -oE 'floor [0-9.]+ ms/token')"
      grep -E "^\| (megakernel|graph|graph-pdl|eager) " "$log"
    done
  fi
  if [[ ",${BENCH:-}," == *",parts,"* ]]; then
    # The megakernel's split-KV parts: OLD_BIN (if given) and this build alternating on each
    # PRESET:PROMPT of PARTS_CASES (64 new tokens), then this build with the parts forced by
    # MEGAINFER_MK_ATTN_PARTS for each PRESET:PROMPT:PARTS of PARTS_SWEEP. PARTS_ROUNDS
    # (default 2) sets the rounds.
    for round in $(seq "${PARTS_ROUNDS:-2}"); do
      for spec in ${PARTS_CASES:-smollm2-135m:8127 llama-3.2-1b:8127}; do
        preset=${spec%%:*}; len=${spec##*:}
        for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
          log="$OUT/bench-parts-$preset-$len-$(basename "$bin")-$round.log"
          "$bin" bench --preset "$preset" --prompt-len "$len" --gen 64 --reps 2 \
            --paths megakernel > "$log" 2>&1
          echo "parts $preset $len $(basename "$bin") round $round: $(row "$log" megakernel)"
        done
      done
    done
    for spec in ${PARTS_SWEEP:-}; do
      IFS=: read -r preset len parts <<< "$spec"
      log="$OUT/bench-parts-sweep-$preset-$len-$parts.log"
      MEGAINFER_MK_ATTN_PARTS=$parts "$MEGAINFER_BIN" bench --preset "$preset" \
        --prompt-len "$len" --gen 64 --reps 2 --paths megakernel > "$log" 2>&1
      echo "parts $preset $len forced $parts: $(row "$log" megakernel)"
    done
  fi
  if [[ ",${BENCH:-}," == *",presets,"* ]]; then
    # Every preset on every decode path, one build: the README's table (PRESETS to narrow).
    for preset in ${PRESETS:-llama-3.2-1b smollm2-135m qwen3-0.6b qwen2.5-0.5b llama-3.2-3b llama-3.1-8b qwen3-1.7b qwen3-4b qwen3-8b qwen2.5-7b}; do
      log="$OUT/bench-presets-${preset/@/-}.log"
      # shellcheck disable=SC2046
      "$MEGAINFER_BIN" bench $(preset_args "$preset") --reps 3 --paths megakernel,graph-pdl,graph > "$log" 2>&1
      for p in megakernel graph-pdl graph; do echo "presets $preset: $(row "$log" "$p")"; done
    done
  fi
  if [[ ",${BENCH:-}," == *",timeline,"* ]]; then
    # Where a layer's time goes: each preset of TIMELINE_PRESETS profiled (`bench --profile
    # --timeline`, 20 new tokens), its per-instruction table and scripts/timeline.py's
    # critical path.
    for preset in ${TIMELINE_PRESETS:-llama-3.2-1b}; do
      name=${preset/@/-}
      log="$OUT/bench-timeline-$name.log"
      # shellcheck disable=SC2046
      "$MEGAINFER_BIN" bench $(preset_args "$preset") --prompt-len "${TIMELINE_PROMPT:-32}" --gen 20 --reps 1 --paths megakernel \
        --profile --timeline "$OUT/timeline-$name.csv" > "$log" 2>&1
      echo "timeline $preset:"
      grep -E "^\| (megakernel|Rms|Attention|AttnReduce|OProj|Down)" "$log"
      # shellcheck disable=SC2086 # TIMELINE_FLAGS is a list of words
      if [ -f "$OUT/timeline-$name.csv" ]; then python3 scripts/timeline.py ${TIMELINE_FLAGS:-} "$OUT/timeline-$name.csv"
        # shellcheck disable=SC2086 # LOADER_RATE is a list of words
        [ -n "${LOADER_RATE:-}" ] && python3 scripts/loader-rate.py "$OUT/timeline-$name.csv" $LOADER_RATE
        # Gzipped, the CSV fits what a call brings back (16 MB a file); both scripts read it so.
        gzip -f "$OUT/timeline-$name.csv"
      else echo "  no timeline written; the end of $log:"; tail -3 "$log"; fi
    done
  fi
  if [[ ",${BENCH:-}," == *",defines,"* ]]; then
    # Megakernel variants of this build: each entry of DEFINES (';'-separated, an empty entry
    # is the default build) as MEGAINFER_MK_DEFINES on each PRESET:PROMPT of DEFINES_CASES
    # (64 new tokens), DEFINES_ROUNDS rounds (default 2).
    sweep defines "${DEFINES_ROUNDS:-2}" "${DEFINES_CASES:-llama-3.2-1b:8127}" "${DEFINES:-}" mk MEGAINFER_MK_DEFINES
  fi
  if [[ ",${BENCH:-}," == *",run,"* ]]; then
    # `megainfer run` on the default model as a user runs it (tokens streamed to stdout, the
    # stats line on stderr): OLD_BIN (if given) and this build alternating, RUN_ROUNDS rounds
    # (default 3) on each path of RUN_PATHS, RUN_TOKENS new tokens (default 256).
    # RUN_VARIANTS: ';'-separated extra arguments for this build only, each run as its own row
    # (e.g. ";--tokens-per-launch 1" for the default and one launch per token).
    IFS=';' read -ra run_variants <<< "${RUN_VARIANTS:-}"
    [ ${#run_variants[@]} -eq 0 ] && run_variants=("")
    for round in $(seq "${RUN_ROUNDS:-3}"); do
      for path in ${RUN_PATHS:-megakernel}; do
        for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
          variants=("${run_variants[@]}"); [ "$bin" != "$MEGAINFER_BIN" ] && variants=("")
          for v in "${variants[@]}"; do
            log="$OUT/run-$path-$(basename "$bin")-$round.log"
            "$bin" run --device cuda --path "$path" -n "${RUN_TOKENS:-256}" ${RUN_ARGS:-} $v \
              -p "${RUN_PROMPT:-Write a long story about a lighthouse keeper.}" > "$log.out" 2> "$log"
            echo "run $path $(basename "$bin") [$v] round $round: $(grep -E 'decode:' "$log" | tail -1)"
          done
        done
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",chat,"* ]]; then
    # `megainfer chat -v` on the default model, the turns of CHAT_INPUT (lines; default three
    # short questions) piped in: OLD_BIN (if given) and this build on each path of CHAT_PATHS,
    # CHAT_TOKENS new tokens at most (default 24); prints each turn's stats line.
    printf '%s\n' "${CHAT_INPUT:-What is the capital of France?
And of Spain?
Name three colours.}" > "$OUT/chat-input.txt"
    for path in ${CHAT_PATHS:-megakernel}; do
      for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
        echo "chat $path $(basename "$bin"):"
        "$bin" chat -v --device cuda --path "$path" -n "${CHAT_TOKENS:-24}" < "$OUT/chat-input.txt" 2>&1 |
          grep -E 'generated at' | sed 's/^/  /'
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",gen,"* ]]; then
    # Generations inside one launch: OLD_BIN (if given) against this build with one launch per
    # token and one per generation (`bench --tokens-per-launch 1,0`) on GEN_CASES (default:
    # SmolLM2, Llama-1B and SmolLM2 quantised to Q4_1 at a 300-token prompt), GEN_ROUNDS rounds
    # (default 2); then the gap between tokens (`bench --profile`) on SmolLM2 and Llama-1B.
    IFS=';' read -ra gen_cases <<< "${GEN_CASES:---preset smollm2-135m;--preset llama-3.2-1b;--preset smollm2-135m --dtype q4_1 --prompt-len 300}"
    for round in $(seq "${GEN_ROUNDS:-2}"); do
      for c in "${gen_cases[@]}"; do
        if [ -n "${OLD_BIN:-}" ]; then
          "$OLD_BIN" bench $c --paths megakernel --reps 5 > "$OUT/gen-old.log" 2>&1
          echo "gen [$c] round $round old: $(row "$OUT/gen-old.log" megakernel)"
        fi
        "$MEGAINFER_BIN" bench $c --paths megakernel --tokens-per-launch 1,0 --reps 5 > "$OUT/gen-new.log" 2>&1
        grep -E "^\| megakernel" "$OUT/gen-new.log" | sed "s/^/gen [$c] round $round new: /"
      done
    done
    for preset in smollm2-135m llama-3.2-1b; do
      "$MEGAINFER_BIN" bench --preset "$preset" --paths megakernel --profile --reps 2 > "$OUT/gen-gap.log" 2>&1
      grep -E "gap between tokens" "$OUT/gen-gap.log" | sed "s/^/$preset: /"
    done
  fi
  if [[ ",${BENCH:-}," == *",sampled,"* ]]; then
    sampled_paths=${SAMPLED_PATHS:-megakernel}
    IFS=';' read -r -a sampled_envs <<< "${SAMPLED_ENV:-}"
    for i in $(seq "${SAMPLED_ROUNDS:-2}"); do
      for preset in ${SAMPLED_PRESETS:-smollm2-135m llama-3.2-1b}; do
        for s in "" "--temperature 0.8 --top-p 0.95"; do
          for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
            log="$OUT/bench-sampled.log"
            "$bin" bench --preset "$preset" --paths "$sampled_paths" --reps 5 $s > "$log" 2>&1
            for p in ${sampled_paths//,/ }; do
              echo "sampled $i $preset $(basename "$bin") [${s:-greedy}]: $(row "$log" "$p")"
            done
          done
        done
        for v in "${sampled_envs[@]}"; do
          [ -n "$v" ] || continue
          read -r -a words <<< "$v"
          log="$OUT/bench-sampled.log"
          env "${words[@]}" "$MEGAINFER_BIN" bench --preset "$preset" --paths "$sampled_paths" --reps 5 \
            --temperature 0.8 --top-p 0.95 > "$log" 2>&1
          for p in ${sampled_paths//,/ }; do
            echo "sampled $i $preset $(basename "$MEGAINFER_BIN") [$v]: $(row "$log" "$p")"
          done
        done
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",mv,"* ]]; then
    mv_row() { echo "$(row "$1" graph-pdl | cut -d'|' -f3) / $(row "$1" graph | cut -d'|' -f3)"; }
    for preset in ${MV_PRESETS:-llama-3.2-1b}; do
      for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
        "$bin" bench --preset "$preset" --paths graph-pdl,graph --reps 3 > "$OUT/mv.log" 2>&1
        echo "mv $preset $(basename "$bin") [chosen]: graph-pdl / graph $(mv_row "$OUT/mv.log")"
      done
      for setting in ${MV_SWEEP:-}; do
        MEGAINFER_BASELINE_MV="$setting" "$MEGAINFER_BIN" bench --preset "$preset" --paths graph-pdl,graph \
          --reps 3 > "$OUT/mv.log" 2>&1
        echo "mv $preset [$setting]: graph-pdl / graph $(mv_row "$OUT/mv.log")"
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",bldefines,"* ]]; then
    sweep bldefines "${BL_ROUNDS:-2}" "${BL_PRESETS:-llama-3.2-1b}" "${BL_DEFINES:-}" graph MEGAINFER_BASELINE_DEFINES
  fi
  if [[ ",${BENCH:-}," == *",blenv,"* ]]; then
    sweep blenv "${BL_ROUNDS:-2}" "${BL_PRESETS:-llama-3.2-1b}" "${BL_ENV:-}" graph words old
  fi
  if [[ ",${BENCH:-}," == *",mkenv,"* ]]; then
    sweep mkenv "${MK_ROUNDS:-2}" "${MK_ENV_CASES:-llama-3.2-1b:32}" "${MK_ENV:-}" mk words
  fi
  if [[ ",${BENCH:-}," == *",draw,"* ]]; then
    for preset in smollm2-135m llama-3.2-1b; do
      for s in "" "--temperature 0.8 --top-p 0.95"; do
        for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
          "$bin" bench --preset "$preset" --paths megakernel --reps 5 $s > "$OUT/draw.log" 2>&1
          echo "draw $preset $(basename "$bin") [${s:-greedy}]: $(row "$OUT/draw.log" megakernel)"
        done
      done
      MEGAINFER_MK_DRAW_IN_LAUNCH=1 "$MEGAINFER_BIN" bench --preset "$preset" --paths megakernel --reps 5 \
        --tokens-per-launch 1,0 --temperature 0.8 --top-p 0.95 > "$OUT/draw.log" 2>&1
      grep -E "^\| megakernel" "$OUT/draw.log" | sed "s/^/draw $preset in launch: /"
    done
  fi
  if [[ ",${BENCH:-}," == *",qwen,"* ]]; then
    for preset in qwen3-0.6b qwen2.5-0.5b; do
      log="$OUT/bench-qwen-$preset.log"
      "$MEGAINFER_BIN" bench --preset "$preset" --reps 3 --paths all > "$log" 2>&1
      echo "$preset:"; grep -E "^\| |skipping" "$log" | grep -v "^| path\|^| ---"
    done
  fi
  if [[ ",${BENCH:-}," == *",mixed,"* ]]; then
    # Layers of different formats (a Q4_K_M file's mix, `bench --q4-k-m-mix`) for each preset of
    # MIXED_PRESETS: the megakernel and graph + PDL reading every layer as stored, and the
    # uniform weights for reference; with OLD_BIN, that binary's mix too (stored-old).
    for preset in ${MIXED_PRESETS:-llama-3.2-1b}; do
      ty=${MIXED_DTYPE:-q4_1}
      for v in uniform stored q6-widened ${OLD_BIN:+stored-old}; do
        log="$OUT/bench-mixed-$preset-$v.log"
        case $v in
          uniform) "$MEGAINFER_BIN" bench --preset "$preset" --dtype "$ty" --paths megakernel --reps 5 > "$log" 2>&1 ;;
          stored) "$MEGAINFER_BIN" bench --preset "$preset" --dtype "$ty" --q4-k-m-mix \
            --paths megakernel,graph-pdl --reps 5 > "$log" 2>&1 ;;
          q6-widened) "$MEGAINFER_BIN" bench --preset "$preset" --dtype "$ty" --q4-k-m-mix --q6-k-widened \
            --paths megakernel,graph-pdl --reps 5 > "$log" 2>&1 ;;
          stored-old) "$OLD_BIN" bench --preset "$preset" --dtype "$ty" --q4-k-m-mix \
            --paths megakernel,graph-pdl --reps 5 > "$log" 2>&1 ;;
        esac
        grep -E "^\| (megakernel|graph-pdl) |weights [0-9.]+ MiB|rror" "$log" | sed "s/^/mixed $preset $ty $v: /"
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",rules,"* ]]; then
    for round in $(seq "${RULES_ROUNDS:-2}"); do
      for rule in "" "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --min-p 0.05"; do
        for bin in ${OLD_BIN:-} "$MEGAINFER_BIN"; do
          # shellcheck disable=SC2086 # the rule is several words
          "$bin" bench --prompt-len 37 --reps 5 --paths megakernel,graph-pdl $rule > "$OUT/bench-rules.log" 2>&1
          echo "rules $round $(basename "$bin") [${rule:-greedy}]: $(grep -E '^\| (megakernel|graph-pdl) ' "$OUT/bench-rules.log" | cut -d'|' -f2,3 | tr '\n' ' ')"
        done
      done
    done
  fi
  if [[ ",${BENCH:-}," == *",smpprof,"* ]]; then
    t=$(ls bundle/tests/gpu_sampler_bench-* 2>/dev/null | grep -v '\.xz$' | head -1)
    if [ -n "$t" ]; then
      MEGAINFER_SAMPLER_DEFINES=-DSMP_PROF=1 timeout 300 "$t" --include-ignored --nocapture > "$OUT/smp-prof.log" 2>&1
      echo "smpprof: rc=$?"
      python3 scripts/smp-prof.py "$OUT/smp-prof.log"
    else
      echo "smpprof: no gpu_sampler_bench binary in bundle/tests"
    fi
  fi
  if [ "${PEERS:-0}" = 1 ]; then
    python3 scripts/peers.py --preset llama-3.2-1b --prefill-lens 1,32,1024,8192,32768 \
      > "$OUT/peers.log" 2>&1
    tail -20 "$OUT/peers.log"
  fi
fi
# ==== end of optional benchmarks ====
# Under DEADLINE the parent saves the cache, once this child has ended or been stopped.
[ -n "${GPU_CHECK_CHILD:-}" ] || save_cache
