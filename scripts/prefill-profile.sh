#!/usr/bin/env bash
# GPU time of one batched prefill, kernel by kernel, under Nsight Compute:
#   scripts/prefill-profile.sh BENCH_ARGS...     e.g. --preset llama-3.2-1b --prompt-len 32
# Runs `megainfer bench BENCH_ARGS --paths megakernel --reps 1 --gen 2` under ncu with the
# clocks and caches left as they are (--clock-control none --cache-control none), so each
# kernel's time is close to its time in a real run, and prints per kernel name the launches and
# microseconds per prefill (the warm-up and the timed run each prefill once), then the total.
# Compare the total with bench's TTFT: the difference is launch gaps and host work.
set -euo pipefail
BIN=${MEGAINFER_BIN:-bundle/megainfer}
NCU=${NCU:-ncu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/prefill-profile-$$.csv"
"$NCU" --csv --print-units base --metrics gpu__time_duration.sum --clock-control none \
  --cache-control none --log-file "$log" \
  "$BIN" bench "$@" --paths megakernel --reps 1 --gen 2 > "$OUT/prefill-profile-$$.bench.log" 2>&1
python3 - "$log" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, body = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
times = collections.defaultdict(list)
order = []
for r in body:
    k = r[name]
    if k.startswith("megakernel") or k == "bw_read":
        continue  # the decode steps and bench's bandwidth probe, not the prefill
    if k not in times:
        order.append(k)
    times[k].append(float(r[value].replace(",", "")) / 1e3)  # ns -> us
embeds = len(times.get("pf_embed", [])) + len(times.get("q_embed_rows", []))
prefills = max(embeds, 1)
total = 0.0
print(f"{'kernel':<70} {'launches':>8} {'us':>9}   (per prefill, {prefills} prefills seen)")
for k in order:
    us = sum(times[k]) / prefills
    total += us
    print(f"{k[:70]:<70} {len(times[k]) / prefills:>8.1f} {us:>9.1f}")
print(f"{'total':<70} {sum(len(v) for v in times.values()) / prefills:>8.1f} {total:>9.1f}")
PY
