#!/usr/bin/env bash
# Where the megakernel's warps stall, under Nsight Compute:
#   scripts/mk-stalls.sh BENCH_ARGS...   e.g. --preset smollm2-135m, --preset llama-3.2-1b --dtype q4_0
# Profiles the second megakernel launch of `megainfer bench BENCH_ARGS --paths megakernel
# --reps 1 --gen 8` (one launch runs the whole generation) with the WarpStateStats section and
# prints, largest first, the cycles a warp spends stalled per instruction it issues, by reason.
# SOURCE=1 profiles with the SourceCounters section too and prints the SASS instructions with
# the most warp samples, each with its top stall reasons (the instruction whose result a stall
# waits for is usually the one just before it).
# The spinning waits (polls of tagged words, page barriers) count as stalls too, so compare
# shapes and builds with each other rather than reading a reason's share as its cost. ncu locks
# the clocks to base, so its kernel time is not a decode time.
set -euo pipefail
BIN=${MEGAINFER_BIN:-bundle/megainfer}
NCU=${NCU:-ncu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/mk-stalls-$$.csv"
"$NCU" --kernel-name regex:megakernel --launch-skip 1 --launch-count 1 --section WarpStateStats \
  --page raw --csv "$BIN" bench "$@" --paths megakernel --reps 1 --gen 8 > "$log" 2>&1
python3 - "$log" <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if len(rows) < 3:
    sys.exit(f"no megakernel launch profiled; see {sys.argv[1]}")
d = dict(zip(rows[0], rows[2]))
pre, post = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
stalls = {k[len(pre):-len(post)]: float(v.replace(",", "") or 0) for k, v in d.items()
          if k.startswith(pre) and k.endswith(post)}
print(f"{'reason':<22} cycles per issued instruction")
for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]):
    if v >= 0.005:
        print(f"{k:<22} {v:6.2f}")
print(f"{'total':<22} {sum(stalls.values()):6.2f}")
PY
[ "${SOURCE:-0}" = 1 ] || exit 0
src="$OUT/mk-source-$$.csv"
"$NCU" --kernel-name regex:megakernel --launch-skip 1 --launch-count 1 --section SourceCounters \
  --import-source no --page source --print-source sass --csv \
  "$BIN" bench "$@" --paths megakernel --reps 1 --gen 8 > "$src" 2>/dev/null
python3 - "$src" "$(dirname "$0")" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from ncu_sass import read
rows = read(sys.argv[1])
total = sum(n for _, n, _ in rows)
print(f"\nSASS with the most warp samples ({total:.0f} samples, {len(rows)} instructions):")
for i, (text, n, why) in sorted(enumerate(rows), key=lambda r: -r[1][1])[:30]:
    top = " ".join(f"{k}:{v:.0f}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])[:3] if v > 0)
    print(f"{i:6d} {100 * n / total:5.1f}%  {text[:56]:56s} {top}")
PY
