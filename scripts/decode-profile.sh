#!/usr/bin/env bash
# GPU time of one decode step on a graph path, kernel by kernel, under Nsight Compute:
#   scripts/decode-profile.sh PATH BENCH_ARGS...   e.g. eager --preset llama-3.2-1b
# Runs `megainfer bench BENCH_ARGS --paths PATH --reps 1 --gen 4` under ncu (clocks and caches
# as they are, so a kernel's time is near its time in a real run; ncu runs kernels one at a
# time, so PDL's overlap is not in these numbers) and prints, for the decode kernels (`bl_*`
# but the embedding lookup), µs per step by kernel name and grid, then the step's total. The
# difference between that total and bench's ms/token on graph + PDL is what PDL's overlap saves.
set -euo pipefail
BIN=${MEGAINFER_BIN:-bundle/megainfer}
NCU=${NCU:-ncu}
OUT=${OUT:-/tmp/out}
path=$1
shift
mkdir -p "$OUT"
log="$OUT/decode-profile-$$.csv"
"$NCU" --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  --clock-control none --cache-control none --log-file "$log" \
  "$BIN" bench "$@" --paths "$path" --reps 1 --gen 4 > "$OUT/decode-profile-$$.bench.log" 2>&1
python3 - "$log" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, body = rows[0], rows[1:]
col = {k: head.index(k) for k in ("ID", "Kernel Name", "Grid Size", "Metric Name", "Metric Value")}
launches = collections.OrderedDict()
for r in body:
    key = r[col["ID"]]
    d = launches.setdefault(key, {"name": r[col["Kernel Name"]], "grid": r[col["Grid Size"]]})
    d[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", ""))
embeds = ("bl_embed", "bl_embed_q")  # one a step, bf16 or quantised table: counts the steps
dec = [d for d in launches.values() if d["name"].startswith("bl_") and d["name"] not in embeds]
steps = sum(1 for d in launches.values() if d["name"] in embeds)
steps = max(steps, 1)
agg = collections.OrderedDict()
for d in dec:
    a = agg.setdefault((d["name"], d["grid"]), [0, 0.0, 0.0])
    a[0] += 1
    a[1] += d.get("gpu__time_duration.sum", 0) / 1e3
    a[2] += d.get("dram__bytes_read.sum", 0)
tot_us = tot_b = 0.0
print(f"{'kernel':<28} {'grid':<16} {'per step':>8} {'us':>9} {'MB':>8} {'GB/s':>7}   ({steps} steps seen)")
for (k, g), (n, us, b) in agg.items():
    tot_us += us / steps
    tot_b += b / steps
    print(f"{k[:28]:<28} {g[:16]:<16} {n / steps:>8.1f} {us / steps:>9.1f} {b / steps / 1e6:>8.1f} {b / us / 1e3 if us else 0:>7.0f}")
print(f"{'total':<45} {len(dec) / steps:>8.1f} {tot_us:>9.1f} {tot_b / 1e6:>8.1f} {tot_b / tot_us / 1e3 if tot_us else 0:>7.0f}")
PY
