#!/usr/bin/env bash
# Runs each cargo-fuzz target in fuzz/ for a given time and prints its counts.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 60 s, all four targets)
# Needs cargo-fuzz (`cargo install cargo-fuzz`). On a stable toolchain RUSTC_BOOTSTRAP=1 lets it
# use the sanitizer flags it needs. New inputs go to target/fuzz-corpus/<target> (seeded from
# the committed fuzz/corpus/<target>), crashes to fuzz/artifacts/<target>; logs to
# target/fuzz-logs/<target>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf hf_dir tokenizer_json chat_template)
export RUSTC_BOOTSTRAP=1
cargo fuzz build
mkdir -p target/fuzz-logs
for t in "${targets[@]}"; do
  mkdir -p "target/fuzz-corpus/$t"
  log="target/fuzz-logs/$t.log"
  # -timeout: an input running over 5 s counts as a hang (a crash artifact).
  # -malloc_limit_mb=64: inputs are at most a few tens of KB, so max(2 x file size, 64 MB) is
  #  64 MB: any single allocation above it is reported as a crash, as is a process over 2 GB.
  set +e
  cargo fuzz run "$t" "target/fuzz-corpus/$t" "fuzz/corpus/$t" -- \
    -max_total_time="$secs" -timeout=5 -rss_limit_mb=2048 -malloc_limit_mb=64 \
    -print_final_stats=1 > "$log" 2>&1
  rc=$?
  set -e
  runs=$(grep -E "stat::number_of_executed_units" "$log" | awk '{print $2}' | tail -1)
  speed=$(grep -E "stat::average_exec_per_sec" "$log" | awk '{print $2}' | tail -1)
  crashes=$(ls "fuzz/artifacts/$t" 2>/dev/null | wc -l)
  printf '%-15s rc=%-3s %6s s  %10s inputs  %7s inputs/s  artifacts: %s\n' \
    "$t" "$rc" "$secs" "$runs" "$speed" "$crashes"
done
