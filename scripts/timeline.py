#!/usr/bin/env python3
"""Summarises a `megainfer bench --profile --timeline FILE` CSV (optionally gzipped).

Prints, as medians over steps 4-15:
- a layer's critical path: for each instruction type, when its first instance started, when
  its last one had its inputs (prepared) and when its last one stored, in µs after the previous
  layer's last down-projection store;
- attention's own steps (inputs, scores + softmax, values, combine + output, store);
- each hop between consecutive stages of a layer: when the first, the median and the last
  consumer instance had its inputs after the producing stage's last store, and the share of
  consumer instances that started after that store (their SM was busy until then);
- each stage's spread: its last instance's store after the median one's (what the slowest SM
  costs the layer, every consumer waiting for the last) and the median's after the first.

With --prep, for a run with MEGAINFER_MK_DEFINES=-DMK_PREP_STAMPS=1 (whose consumer thread 0
stamps the extra words: before the prepare, and once its own inputs have settled), the
prepare of each mat-vec instruction, split by whether it started before or after its
producers' last store: start to thread 0's inputs settled, and from there to prepared.

With --tiles, for a run with MEGAINFER_MK_DEFINES=-DMK_TILE_STAMPS=1 (consumer thread 0 stamps
the extra words when its first page wait returned and when its own warp finished its tiles),
each mat-vec kind's medians of: prepared to the first page ready, warp 0's own tiles, the wait
for the other warps (to the tiles stamp) and the post stage (to stored).

Where the schedule has split-KV merges (AttnReduce), each merge's start and end (prepared:
its work is all prepare) after its own KV head's last attention part stored.

Attention's steps read its words 4 and 5 as the consumers write them; a run built with
-DMK_ATT_LOADER_STAMPS=1 has the loader's there instead (scripts/loader-rate.py reads those).
With --att-pages, for a run with -DMK_ATT_PAGE_STAMPS=1 (word 5 of a part computed by warps is
when consumer warp 0's last page wait returned), attention's steps are its inputs, the time to
that last page, the rest of the part's tiles, and the merge with the store. With --att-issue,
for a run with -DMK_ATT_PAGE_STAMPS=2 or 3, word 4 is when the loader issued that page's tile
(=2) or when warp 0 began waiting for it (=3), and attention's steps are its inputs, word 4
after the inputs (negative: before), word 4 to the wait's return (deciles too: with =3 the
wait itself), and the rest to the store.
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


def last_store(by_layer, step, layer, kinds, prod, previous_layer):
    """When the producing stage's last instance stored (the previous layer's, for a stage that
    reads the layer before), or None where the layer has no such stage."""
    src = by_layer.get((step, layer - 1), {}) if previous_layer else kinds
    return max(x[3] for x in src[prod]) if prod in src else None


def prep(by_layer):
    """The MK_PREP_STAMPS split of each mat-vec instruction's prepare (see the module doc)."""
    producer = {"RmsQkvRope": "DownProjPartial", "OProjResidual": "Attention",
                "RmsUpGateSilu": "OProjResidual", "DownProjPartial": "RmsUpGateSilu"}
    print("prepare (µs; started before / after the producers' last store: instances, "
          "start to settled, settled to prepared):")
    for cons, prod in producer.items():
        split = {"before": ([], []), "after": ([], [])}
        for (step, layer), kinds in by_layer.items():
            t0 = last_store(by_layer, step, layer, kinds, prod, cons == "RmsQkvRope")
            if t0 is None or cons not in kinds:
                continue
            for x in kinds[cons]:
                a, b = split["after" if x[0] > t0 else "before"]
                a.append(x[5] - x[0])
                b.append(x[1] - x[5])
        cols = [f"{len(a):6d} {st.median(a):5.2f} {st.median(b):5.2f}" if a else "     0" for a, b in split.values()]
        print(f"  {cons:16s} {cols[0]}  |  {cols[1]}")


def tiles(records):
    """Each mat-vec kind's tiles split by the MK_TILE_STAMPS stamps (see the module's text)."""
    split = defaultdict(lambda: ([], [], [], []))
    for r in records:
        if r["kind"] in ("Attention", "AttnReduce", "Argmax"):
            continue
        prepared, tiles_done, e1, e2, stored = (int(r[k]) for k in ("prepared", "tiles", "extra1", "extra2", "stored"))
        if e1 == 0 or e2 == 0:
            continue
        v = split[r["kind"]]
        for i, d in enumerate((e1 - prepared, e2 - e1, tiles_done - e2, stored - tiles_done)):
            v[i].append(d / 1000)
    print("tiles (µs, medians; MK_TILE_STAMPS): prepared -> first page ready, warp 0's tiles, "
          "the other warps, post")
    for kind, v in sorted(split.items()):
        print(f"  {kind:16s} " + " ".join(f"{st.median(x):6.2f}" for x in v))


def merges(records):
    """Each AttnReduce's start and end after its KV head's last attention part stored."""
    parts, reduces = defaultdict(list), []
    for r in records:
        m = re.search(r"layer: (\d+), kv_head: (\d+)", r["desc"])
        if not m:
            continue
        key = (r["step"], m.group(1), m.group(2))
        if r["kind"] == "Attention":
            parts[key].append(int(r["stored"]))
        elif r["kind"] == "AttnReduce":
            reduces.append((key, int(r["start"]), int(r["prepared"])))
    if not reduces:
        return
    start = [(s - max(parts[k])) / 1000 for k, s, _ in reduces if parts[k]]
    end = [(e - max(parts[k])) / 1000 for k, _, e in reduces if parts[k]]
    print(f"split-KV merges (µs after their head's last part stored): start {st.median(start):5.2f}, "
          f"done {st.median(end):5.2f} (deciles {st.quantiles(end, n=10)[0]:.2f} .. {st.quantiles(end, n=10)[-1]:.2f})")


def main(path, with_prep=False, with_tiles=False, att_pages=False, att_issue=False):
    records = list(rows(path))
    by_layer = defaultdict(lambda: defaultdict(list))
    attention = []
    for r in records:
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
        steps = [("inputs", 0, 1), ("scores + softmax", 1, 4), ("values", 4, 5),
                 ("combine + output", 5, 2), ("store", 2, 3)]
        if att_pages:
            steps = [("inputs", 0, 1), ("to warp 0's last page", 1, 5), ("the rest of the tiles", 5, 4),
                     ("merge + store", 4, 3)]
        if att_issue:
            steps = [("inputs", 0, 1), ("to word 4", 1, 4), ("word 4 to wait return", 4, 5),
                     ("then to the store", 5, 3)]
        for name, a, b in steps:
            print(f"  {name:22s} {st.median(x[b] - x[a] for x in attention):6.2f}")
        if att_issue:
            d = st.quantiles([x[5] - x[4] for x in attention], n=10)
            print("  word 4 to wait return, deciles: " + " ".join(f"{v:.2f}" for v in d))
    hops(by_layer)
    spread(by_layer)
    merges(records)
    if with_prep:
        prep(by_layer)
    if with_tiles:
        tiles(records)


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
            t0 = last_store(by_layer, step, layer, kinds, prod, prod == present[-1])
            if t0 is None or cons not in kinds:
                continue
            ready = sorted(x[1] - t0 for x in kinds[cons])
            first.append(ready[0])
            med.append(st.median(ready))
            last.append(ready[-1])
            late.append(sum(1 for x in kinds[cons] if x[0] > t0) / len(kinds[cons]))
        if first:
            print(f"  {prod:16s} -> {cons:16s} {st.median(first):5.2f} {st.median(med):5.2f} "
                  f"{st.median(last):5.2f}  {100 * st.median(late):3.0f}%")


def spread(by_layer):
    """Per stage, medians over the layers of how far apart its instances store: the last
    instance's store after the median one's, and the median one's after the first. Every
    stage's consumers wait for the last, so the first figure is what each stage's slowest SM
    costs the layer."""
    print("stage spread (µs; last store after the median instance's / the median's after the first):")
    for k in ORDER:
        late, early = [], []
        for kinds in by_layer.values():
            if k in kinds and len(kinds[k]) > 1:
                stores = sorted(x[3] for x in kinds[k])
                late.append(stores[-1] - st.median(stores))
                early.append(st.median(stores) - stores[0])
        if late:
            print(f"  {k:16s} {st.median(late):5.2f} / {st.median(early):5.2f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--prep", "--tiles", "--att-pages", "--att-issue")]
    if len(args) != 1:
        sys.exit("usage: timeline.py [--prep] [--tiles] [--att-pages | --att-issue] TIMELINE.csv[.gz]")
    flags = sys.argv[1:]
    main(args[0], "--prep" in flags, "--tiles" in flags, "--att-pages" in flags, "--att-issue" in flags)
