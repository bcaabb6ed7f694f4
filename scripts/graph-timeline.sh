#!/usr/bin/env bash
# Where a graph path's decode step goes, with PDL's overlap in it, under Nsight Systems:
#   scripts/graph-timeline.sh PATH BENCH_ARGS...   e.g. graph-pdl --preset llama-3.2-1b
# Runs `megainfer bench BENCH_ARGS --paths PATH --reps 1 --gen 24` under nsys (the CUDA graph
# traced node by node) and prints, per kernel of a step (by name and its place in the layer),
# the median spacing between the ends of consecutive kernels: the time each kernel adds to
# the step, overlap included (decode-profile.sh runs kernels one at a time instead), and the
# median of its own duration (from its launch, waits under PDL included).
set -euo pipefail
BIN=${MEGAINFER_BIN:-bundle/megainfer}
# Nsight Systems: on PATH, else the copy Nsight Compute ships (the GPU machine has only that one).
NSYS=${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1 || true)}
[ -n "$NSYS" ] || { echo "graph-timeline.sh: nsys not found (set NSYS)" >&2; exit 1; }
OUT=${OUT:-/tmp/out}
path=$1
shift
mkdir -p "$OUT"
rep="$OUT/graph-timeline-$$"
"$NSYS" profile -t cuda --cuda-graph-trace=node -o "$rep" --force-overwrite true \
  "$BIN" bench "$@" --paths "$path" --reps 1 --gen 24 > "$rep.bench.log" 2>&1
# Nsight Compute's copy of nsys leaves a .qdstrm for its importer to turn into a report.
if [ ! -f "$rep.nsys-rep" ] && [ -f "$rep.qdstrm" ]; then
  imp=$(ls "$(dirname "$NSYS")"/QdstrmImporter "$(dirname "$NSYS")"/../*/QdstrmImporter 2>/dev/null | head -1 || true)
  [ -n "$imp" ] || { echo "graph-timeline.sh: no QdstrmImporter beside $NSYS" >&2; exit 1; }
  # It wants libdw.so.1, which the GPU machine lacks: IMPORTER_LIBS names a folder holding it.
  LD_LIBRARY_PATH="${IMPORTER_LIBS:-}${IMPORTER_LIBS:+:}${LD_LIBRARY_PATH:-}" "$imp" -i "$rep.qdstrm" > /dev/null
fi
"$NSYS" export --type sqlite -o "$rep.sqlite" --force-overwrite true "$rep.nsys-rep" > /dev/null
python3 - "$rep.sqlite" <<'PY'
import sqlite3, sys, statistics, collections
db = sqlite3.connect(sys.argv[1])
q = ("SELECT k.start, k.end - k.start, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
     "JOIN StringIds s ON s.id = k.shortName ORDER BY k.start")
ks = [(a, d, n) for a, d, n in db.execute(q) if n.startswith(("bl_", "smp_"))]
# Steps start at the embedding lookup; keep the last steps (the timed decode), whole ones.
starts = [i for i, k in enumerate(ks) if k[2].startswith("bl_embed")]
steps = [ks[a:b] for a, b in zip(starts, starts[1:])][-16:]
if not steps:
    sys.exit("no decode steps found")
spacing = collections.defaultdict(list)
dur = collections.defaultdict(list)
order = []
for st in steps:
    seen = collections.Counter()
    prev_end = st[0][0] + st[0][1]
    for s, d, n in st[1:]:
        key = (n, seen[n])
        seen[n] += 1
        if key not in spacing and len(order) < 400:
            order.append(key)
        spacing[key].append((s + d - prev_end) / 1e3)
        dur[key].append(d / 1e3)
        prev_end = s + d
names = collections.OrderedDict()
for n, i in order:
    a = names.setdefault(n, [0, [], []])
    a[0] += 1
    a[1].append(statistics.median(spacing[(n, i)]))
    a[2].append(statistics.median(dur[(n, i)]))
step_us = statistics.median([(st[-1][0] + st[-1][1] - st[0][0]) / 1e3 for st in steps])
print(f"{'kernel':<28} {'per step':>8} {'end-to-end us':>14} {'sum us':>8} {'own us':>8}   ({len(steps)} steps, median step {step_us:.1f} us)")
for n, (c, sp, du) in names.items():
    print(f"{n[:28]:<28} {c:>8} {statistics.median(sp):>14.2f} {sum(sp):>8.1f} {statistics.median(du):>8.2f}")
print("the step's first kernels in order (end-to-end / own, us):")
print("  " + ", ".join(f"{n} {statistics.median(spacing[(n, i)]):.2f}/{statistics.median(dur[(n, i)]):.2f}" for n, i in order[:12]))
PY
rm -f "$rep.qdstrm" "$rep.nsys-rep" "$rep.sqlite"
