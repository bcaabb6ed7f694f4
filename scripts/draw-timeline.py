#!/usr/bin/env python3
"""Where a step's end goes: the LM head, the draw or argmax, for `megainfer bench --profile
--timeline FILE` CSVs (optionally gzipped), medians over steps 4-15, µs after the step's
first instruction started.

Usage: draw-timeline.py LABEL=FILE [LABEL=FILE ...]

For each file: the LM-head blocks' first start, their dot products done (first, median,
last), their post stage stored (last: for a draw inside the launch, the last block's arrival),
and the token: greedy runs, the Argmax instruction's store; a launch drawing inside it built
with MEGAINFER_MK_DEFINES=-DMK_SMP_STAMPS=1, the drawing SM's extra word 2. With the stamps,
extra word 1 of each block is when it had the vocabulary's maximum (first, median, last).
"""
import csv
import gzip
import statistics as st
import sys
from collections import defaultdict


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    steps = defaultdict(list)
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            if 4 <= int(r["step"]) <= 15:
                steps[int(r["step"])].append(r)
    return steps


def summary(steps):
    cols = defaultdict(list)
    for rs in steps.values():
        lm = [r for r in rs if r["kind"] == "RmsLmHead"]
        if not lm:
            continue
        t = lambda r, k: int(r[k]) / 1e3
        tiles = sorted(t(r, "tiles") for r in lm)
        cols["LM head first start"].append(min(t(r, "start") for r in lm))
        cols["dot products done: first"].append(tiles[0])
        cols["dot products done: median"].append(st.median(tiles))
        cols["dot products done: last"].append(tiles[-1])
        ends = [r for r in rs if r["kind"] in ("RmsLmHead", "Argmax")]
        draw = max((t(r, "extra2") for r in ends), default=0)
        drawer = [r for r in ends if draw > 0 and t(r, "extra2") == draw]
        x1 = sorted(t(r, "extra1") for r in lm if int(r["extra1"]) > 0 and r not in drawer)
        if x1:
            cols["maximum known: first"].append(x1[0])
            cols["maximum known: median"].append(st.median(x1))
            cols["maximum known: last"].append(x1[-1])
        arrived = max(t(r, "stored") for r in lm)
        cols["post stored: last"].append(arrived)
        am = [r for r in rs if r["kind"] == "Argmax"]
        if draw > 0 and draw > tiles[-1]:
            # MK_SMP_WARM: the drawing SM's extra word 1 is its first drawing's end.
            if drawer and t(drawer[0], "extra1") > arrived:
                cols["first drawing done (warm-up)"].append(t(drawer[0], "extra1"))
            cols["token (draw)"].append(draw)
        elif am:
            cols["token (argmax stored)"].append(max(t(r, "stored") for r in am))
        if drawer:
            # MK_SMP_STAMPS=2: the draw's phases in the drawing SM's first instructions.
            mine = sorted((r for r in rs if r["sm"] == drawer[0]["sm"]), key=lambda r: int(r["pos"]))
            ph = [t(mine[k // 2], "extra1" if k % 2 == 0 else "extra2") for k in range(len(PHASES))]
            for k in (5, 0, 1, 2, 6, 7, 8, 9, 3, 4):
                if ph[k] > arrived - 5:
                    cols[PHASES[k]].append(ph[k])
    out = {k: st.median(v) for k, v in cols.items()}
    if "token (draw)" in cols and len(cols["token (draw)"]) == len(cols["post stored: last"]):
        # Per step: a draw that searched the whole vocabulary shows as a long one.
        spans = sorted(t - a for t, a in zip(cols["token (draw)"], cols["post stored: last"]))
        out["last arrival to token: shortest"] = spans[0]
        out["last arrival to token: longest"] = spans[-1]
    return out


PHASES = ["draw: summaries and first slots loaded", "draw: second load done", "draw: union counted",
          "draw: binned merge done", "draw: attempt checked", "draw: started",
          "draw: binned: keys counted", "draw: binned: bins scanned", "draw: binned: keys placed",
          "draw: binned: ranked and scored"]


def main():
    runs = [a.split("=", 1) for a in sys.argv[1:]]
    sums = [(label, summary(load(path))) for label, path in runs]
    keys = []
    for _, s in sums:
        keys += [k for k in s if k not in keys]
    print("| µs after the step's start | " + " | ".join(l for l, _ in sums) + " |")
    print("| --- |" + " ---: |" * len(sums))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{s[k]:.2f}" if k in s else "" for _, s in sums) + " |")


if __name__ == "__main__":
    main()
