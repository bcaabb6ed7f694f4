#!/usr/bin/env python3
"""Per instruction type, how fast the megakernel's loader streamed weights, from a
`megainfer bench --profile --timeline FILE` CSV (optionally gzipped):

    scripts/loader-rate.py FILE HIDDEN INTERMEDIATE [HEAD_DIM CONTEXT]

Medians over steps 4-15 of: the loader's issue window (first page wait to last tile issued),
the consumers' wait for inputs (start to prepared) and their tiles (prepared to tiles done),
the tiles' end after the loader issued the last one, and for the mat-vecs with a known row
size the bytes over the issue window (GB/s per SM; x 132 for the whole GPU; bf16 bytes, so a
quantised run's rate reads high by the formats' ratio). QKV rows vary by head and are left without a rate.
With HEAD_DIM and CONTEXT (the step's sequence length), for a run built with
MEGAINFER_MK_DEFINES=-DMK_ATT_LOADER_STAMPS=1, attention's K/V tiles too: a part's
2 x HEAD_DIM x 2 bytes a position over CONTEXT / parts positions.
"""
import csv
import gzip
import re
import statistics as st
import sys
from collections import defaultdict


def main(path, hidden, inter, head_dim=0, context=0):
    opener = gzip.open if path.endswith(".gz") else open
    kinds = defaultdict(list)
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            if not 4 <= int(r["step"]) <= 15:
                continue
            kind, desc = r["kind"], r["desc"]

            def field(name):
                return int(re.search(name + r": (\d+)", desc).group(1))

            if kind == "RmsUpGateSilu":
                size = field("row_count") * 2 * hidden * 2
            elif kind == "DownProjPartial":
                size = field("row_count") * field("col_count") * 2
            elif kind == "OProjResidual":
                size = field("row_count") * hidden * 2
            elif kind == "RmsQkvRope":
                size = None
            elif kind == "Attention" and head_dim:
                size = 4 * head_dim * context // field("parts")
            else:
                continue
            t = [int(r[k]) for k in ("start", "prepared", "tiles", "stored", "extra1", "extra2")]
            kinds[kind].append((size, t))
    for kind, rows in kinds.items():
        issue = st.median(t[5] - t[4] for _, t in rows) / 1000
        wait = st.median(t[1] - t[0] for _, t in rows) / 1000
        tiles = st.median(t[2] - t[1] for _, t in rows) / 1000
        # The tiles' end after the loader issued the last of them: about a load's latency when
        # the consumers wait for the loader, more when they take longer than the weights do.
        tail = st.median(t[2] - t[5] for _, t in rows) / 1000
        line = (f"{kind:16s} n={len(rows):6d}  loader issue {issue:5.1f} us  inputs {wait:4.1f} us"
                f"  tiles {tiles:5.1f} us  last issue to tiles done {tail:5.2f} us")
        size = rows[0][0]
        if size:
            rate = st.median(b / (t[5] - t[4]) for b, t in rows if t[5] > t[4])
            line += f"  {size / 1024:.0f} KiB  {rate:.1f} GB/s per SM"
        print(line)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 6):
        sys.exit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
