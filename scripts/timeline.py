#!/usr/bin/env python3
"""Summarises a `megainfer bench --profile --timeline FILE` CSV (optionally gzipped).

Prints, as medians over steps 4-15:
- a layer's critical path: for each instruction type, when its first instance started, when
  its last one had its inputs (prepared) and when its last one stored, in µs after the previous
  layer's last down-projection store;
- attention's own steps (inputs, scores + softmax, values, combine + output, store);
- each hop between consecutive stages of a layer: when the first, the median and the last
  consumer instance had its inputs after the producing stage's last store, and the share of
  consumer instances that started after that store (their SM was busy until then).
"""
import csv
import gzip
import re
import statistics as st
import sys
from collections import defaultdict

ORDER = ["RmsQkvRope", "Attention", "AttnReduce", "OProjResidual", "RmsUpGateSilu", "DownProjPartial"]
STAMPS = ("start", "prepared", "tiles", "stored", "extra1", "extra2")


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            if 4 <= int(r["step"]) <= 15:
                yield r


def main(path):
    by_layer = defaultdict(lambda: defaultdict(list))
    attention = []
    for r in rows(path):
        t = [int(r[k]) / 1000 for k in STAMPS]
        m = re.search(r"layer: (\d+)", r["desc"])
        if m:
            by_layer[(r["step"], int(m.group(1)))][r["kind"]].append(t)
        if r["kind"] == "Attention":
            attention.append(t)
    chain = defaultdict(list)
    for (step, layer), kinds in by_layer.items():
        prev = by_layer.get((step, layer - 1), {}).get("DownProjPartial")
        if not prev:
            continue
        t0 = max(x[3] for x in prev)
        for k in ORDER:
            if k in kinds:
                chain[k].append((min(x[0] for x in kinds[k]) - t0, max(x[1] for x in kinds[k]) - t0,
                                 max(x[3] for x in kinds[k]) - t0))
    print("critical path of a layer (µs after the previous layer's last down-proj store):")
    for k in ORDER:
        if chain[k]:
            first, ready, stored = (st.median(v[i] for v in chain[k]) for i in range(3))
            print(f"  {k:18s} first start {first:6.1f}  last prepared {ready:6.1f}  last stored {stored:6.1f}")
    if attention:
        print("attention (µs):")
        for name, a, b in [("inputs", 0, 1), ("scores + softmax", 1, 4), ("values", 4, 5),
                           ("combine + output", 5, 2), ("store", 2, 3)]:
            print(f"  {name:18s} {st.median(x[b] - x[a] for x in attention):6.2f}")
    hops(by_layer)


def hops(by_layer):
    """Per hop, medians over the layers of: the first, median and last consumer instance's
    inputs (prepared) after the producers' last store, and the share of consumer instances
    that started after that store."""
    present = [k for k in ORDER if any(k in kinds for kinds in by_layer.values())]
    pairs = list(zip(present, present[1:])) + [(present[-1], present[0])]
    print("hops (µs after the producers' last store; first / median / last consumer ready; late starters):")
    for prod, cons in pairs:
        first, med, last, late = [], [], [], []
        for (step, layer), kinds in by_layer.items():
            wrap = prod == present[-1]
            src = by_layer.get((step, layer - 1), {}) if wrap else kinds
            if prod not in src or cons not in kinds:
                continue
            t0 = max(x[3] for x in src[prod])
            ready = sorted(x[1] - t0 for x in kinds[cons])
            first.append(ready[0])
            med.append(st.median(ready))
            last.append(ready[-1])
            late.append(sum(1 for x in kinds[cons] if x[0] > t0) / len(kinds[cons]))
        if first:
            print(f"  {prod:16s} -> {cons:16s} {st.median(first):5.2f} {st.median(med):5.2f} "
                  f"{st.median(last):5.2f}  {100 * st.median(late):3.0f}%")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: timeline.py TIMELINE.csv[.gz]")
    main(sys.argv[1])
