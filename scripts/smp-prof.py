#!/usr/bin/env python3
"""Summarises a gpu_sampler_bench log run with MEGAINFER_SAMPLER_DEFINES=-DSMP_PROF=1.

The fused sampler's drawing CTA prints one draw in 40 ("smp-prof nb N pos P attempt A verdict
V: start ... merge ..."): ns after the earliest CTA's start for each phase. The test prints a
line per case after that case's draws; this prints each case line, then for each CTA count and
attempt outcome the median of every phase.

Usage: scripts/smp-prof.py LOG
"""
import re
import statistics
import sys

PHASES = ["start", "loaded+max", "exchanged", "emitted", "last", "drawn", "stored",
          "merge:loads", "merge:reductions", "merge:chosen", "merge:ranked", "merge:drawn"]


def main(path):
    pending = []
    for line in open(path, errors="replace"):
        if line.startswith("smp-prof"):
            head, tail = line.split(":", 1)
            nb, _pos, att, ver = map(int, re.findall(r"\d+", head))
            pending.append(((nb, att, ver), [int(x) for x in re.findall(r"-?\d+", tail)]))
        elif line.startswith("  ") and "two-kernel" in line:
            print(line.rstrip())
            groups = {}
            for key, nums in pending:
                groups.setdefault(key, []).append(nums)
            for (nb, att, ver), rows in sorted(groups.items()):
                med = [int(statistics.median(r[i] for r in rows)) for i in range(min(map(len, rows)))]
                cells = " ".join(f"{name} {v}" for name, v in zip(PHASES, med))
                print(f"    {nb} CTAs, attempt {att}, verdict {ver}, {len(rows)} draws: {cells}")
            pending = []
        elif line.strip() and not line.startswith(("test ", "running")):
            print(line.rstrip())


if __name__ == "__main__":
    main(sys.argv[1])
