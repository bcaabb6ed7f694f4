#!/usr/bin/env python3
"""Compares the generated tokens of `megainfer run --json` outputs.

Usage: same-tokens.py LABEL NAME=FILE NAME=FILE [NAME=FILE ...]
Prints LABEL, each run's token count, and for each file after the first whether its tokens
equal the previous file's ("identical", or where they first differ).
"""
import json
import sys


def main():
    label, runs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    ids = []
    for name, path in runs:
        try:
            ids.append((name, json.load(open(path))["generated_ids"]))
        except (OSError, ValueError, KeyError) as e:
            print(f"{label}: no tokens from {name} ({path}: {e})")
            sys.exit(1)
    parts = [label + ":", " ".join(f"{name} {len(t)}" for name, t in ids)]
    for (na, a), (nb, b) in zip(ids, ids[1:]):
        if a == b:
            verdict = "identical"
        else:
            at = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
            verdict = f"DIFFER at {at}"
        parts.append(f"; {na} vs {nb} {verdict}")
    print(" ".join(parts))


if __name__ == "__main__":
    main()
