#!/usr/bin/env bash
# Runs every GPU check in one device call; builds nothing. Expects in .carry/:
#   megainfer, tests/<test binaries>, and optionally model.gguf.part-{a,b}: the default model
#   split in two (98 MB is over one call's transfer limit). A part found in .carry/ is moved to
#   /root/models, and the model is joined there once both parts have arrived.
# GPU tests are #[ignore = "needs a GPU"]: every binary runs with --include-ignored, so the
# table's "ignored" column must read 0 (docs/gpu-machine.md).
# Prints a short table last; full logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/models
export MEGAINFER_CACHE=/root/mcache
mkdir -p "$MEGAINFER_CACHE"
MODEL="$MEGAINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
for part in a b; do
  [ -f .carry/model.gguf.part-$part ] && cp .carry/model.gguf.part-$part /root/models/
done
if [ ! -f "$MODEL" ] && [ -f /root/models/model.gguf.part-a ] && [ -f /root/models/model.gguf.part-b ]; then
  cat /root/models/model.gguf.part-a /root/models/model.gguf.part-b > "$MODEL"
fi
[ -f "$MODEL" ] && echo "default model present: $(sha256sum "$MODEL" | cut -c1-16)" || echo "default model NOT present"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader

declare -a rows
for t in ${TESTS:-.carry/tests/*}; do
  name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
  start=$(date +%s.%N)
  "$t" --include-ignored --test-threads=1 --nocapture ${TEST_FILTER:-} > "$OUT/$name.log" 2>&1
  rc=$?
  secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  summary=$(grep -E "^test result:" "$OUT/$name.log" | tail -1)
  ignored=$(sed -nE 's/^test result:.* ([0-9]+) ignored.*/\1/p' "$OUT/$name.log" | tail -1)
  rows+=("$(printf '%-28s rc=%-3s %6ss ignored=%s %s' "$name" "$rc" "$secs" "${ignored:-?}" "$summary")")
  grep -E "rel L2|tok/s|ms/token|near-tie|FAILED|panicked|error" "$OUT/$name.log" | tail -40
done
if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA" 2>&1 | tee "$OUT/extra.log"; fi
echo
echo "=== GPU check summary ==="
printf '%s\n' "${rows[@]}"
