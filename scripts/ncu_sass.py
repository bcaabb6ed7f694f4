"""Reads the SASS page of an Nsight Compute CSV (`ncu --section SourceCounters --page source
--print-source sass --csv`, as scripts/mk-stalls.sh writes it with SOURCE=1): for
scripts/mk-stalls.sh and scripts/sass-by-source.py."""
import csv
import sys


def read(path):
    """Per SASS instruction, in address order: (its text, its warp samples, {stall reason:
    samples}); exits naming the file where it holds no SASS page."""
    lines = open(path).readlines()
    start = [i for i, text in enumerate(lines) if text.startswith('"Address"')]
    if not start:
        sys.exit(f"{path}: no SASS page (scripts/mk-stalls.sh with SOURCE=1 writes one)")
    rows = list(csv.DictReader(lines[start[0]:]))
    num = lambda x: float(x.replace(",", "") or 0) if x else 0.0
    total = "Warp Stall Sampling (All Samples)"
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    return [(r["Source"].strip(), num(r[total]), {c[6:]: num(r[c]) for c in reasons}) for r in rows]
