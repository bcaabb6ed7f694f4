#!/usr/bin/env python3
"""How much of a megakernel CUBIN's code each source file and function makes up.

Usage: scripts/sass-by-source.py CUBIN SOURCE [TOP]
  CUBIN:  a megakernel compiled with line info, e.g. from
          `MEGAINFER_MK_DEFINES=-lineinfo MEGAINFER_CACHE=DIR megainfer schedule --preset NAME
          --context 161 --compile-kernels h200` (DIR/kernels/megakernel-*.cubin);
  SOURCE: the source it was compiled from, `cargo run --release --example megakernel_source`;
  TOP:    how many functions to list (default 30).
Runs `nvdisasm -g -c` (NVDISASM in the environment, else on the PATH; `pip install
nvidia-cuda-nvdisasm` has one) and attributes each SASS instruction to the line its line info
names: the file of the repository that line comes from, and the nearest `__device__` function
above it (inlined helpers count where they are written, so `dot8` stands for every tile loop
that inlines it). Prints instructions and KiB per file, then per function, largest first.
"""
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def file_spans(source):
    """(first line, last line, path) of each repository .cuh/.cu file found whole in source."""
    spans = []
    for path in sorted(list(ROOT.glob("megakernel/**/*.cu*")) + list(ROOT.glob("kernels/**/*.cu*"))):
        text = path.read_text()
        at = source.find(text)
        if at >= 0 and text.strip():
            first = source.count("\n", 0, at) + 1
            spans.append((first, first + text.count("\n"), str(path.relative_to(ROOT))))
    return sorted(spans)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cubin, source_path = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    source = Path(source_path).read_text()
    lines = source.split("\n")
    spans = file_spans(source)
    fn_re = re.compile(r"__device__[^(]*?\b(\w+)\s*\(")
    fn_at = {}

    def function(line):
        if line not in fn_at:
            name = "?"
            for k in range(line - 1, max(-1, line - 400), -1):
                m = fn_re.search(lines[k]) if k < len(lines) else None
                if m:
                    name = m.group(1)
                    break
            fn_at[line] = name
        return fn_at[line]

    def file_of(line):
        for first, last, path in spans:
            if first <= line <= last:
                return path
        return "(generated: the ABI prelude and checks)"

    nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
    out = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    per_file, per_fn = collections.Counter(), collections.Counter()
    line = None
    for text in out.split("\n"):
        m = re.search(r'//## File "[^"]*", line (\d+)', text)
        if m:
            line = int(m.group(1))
        elif line and re.search(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@{]", text):
            f = file_of(line)
            per_file[f] += 1
            per_fn[(f.rsplit("/", 1)[-1], function(line))] += 1
    total = sum(per_file.values())
    print(f"{total} instructions with line info ({total * 16 / 1024:.0f} KiB)")
    for f, n in per_file.most_common():
        print(f"{n:7d} {n * 16 / 1024:7.1f} KiB  {f}")
    print()
    for (f, fn), n in per_fn.most_common(top):
        print(f"{n:7d} {n * 16 / 1024:7.1f} KiB  {f}: {fn}")


if __name__ == "__main__":
    main()
