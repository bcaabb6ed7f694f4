#!/usr/bin/env python3
"""How much of a megakernel CUBIN's code, or of its warps' time, each source file and function
makes up.

Usage: scripts/sass-by-source.py CUBIN SOURCE [TOP] [--samples NCU_SOURCE_CSV]
  CUBIN:  a megakernel compiled with line info, e.g. from
          `MEGAINFER_MK_DEFINES=-lineinfo MEGAINFER_CACHE=DIR megainfer schedule --preset NAME
          --context 161 --compile-kernels h200` (DIR/kernels/megakernel-*.cubin);
  SOURCE: the source it was compiled from, `cargo run --release --example megakernel_source`;
  TOP:    how many functions (and with --samples, source lines) to list (default 30);
  --samples: the SASS page scripts/mk-stalls.sh writes with SOURCE=1 ($OUT/mk-source-*.csv)
          for a launch of this very CUBIN (profile with the same MEGAINFER_MK_DEFINES and carry
          DIR's cache, so that the GPU machine loads it rather than compiling its own): each
          instruction then weighs its warp samples instead of 1, and the lines with the most
          samples are listed with their top stall reasons.
Runs `nvdisasm -g -c` (NVDISASM in the environment, else on the PATH; `pip install
nvidia-cuda-nvdisasm` has one) and attributes each SASS instruction to the line its line info
names: the file of the repository that line comes from, and the nearest `__device__` function
above it (inlined helpers count where they are written, so `dot8` stands for every tile loop
that inlines it). Prints instructions and KiB (or shares of the samples) per file, then per
function, largest first.
"""
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import ncu_sass

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
    args = sys.argv[1:]
    samples = None
    if "--samples" in args:
        at = args.index("--samples")
        if at + 1 >= len(args):
            sys.exit(__doc__)
        samples = [(n, why) for _, n, why in ncu_sass.read(args[at + 1])]
        del args[at : at + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    cubin, source_path = args[0], args[1]
    top = int(args[2]) if len(args) > 2 else 30
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
    # The line each instruction comes from, in address order (None before the first line info).
    at_line = []
    line = None
    for text in out.split("\n"):
        m = re.search(r'//## File "[^"]*", line (\d+)', text)
        if m:
            line = int(m.group(1))
        elif re.search(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@{]", text):
            at_line.append(line)
    if samples is not None and len(samples) != len(at_line):
        sys.exit(
            f"{len(samples)} profiled instructions against {len(at_line)} in {cubin}: "
            "not the CUBIN that was profiled"
        )
    weights = [s[0] for s in samples] if samples else [1.0] * len(at_line)
    per_file, per_fn, per_line = collections.Counter(), collections.Counter(), collections.Counter()
    why = collections.defaultdict(collections.Counter)
    for i, (line, wgt) in enumerate(zip(at_line, weights)):
        f = file_of(line) if line else "(no line info)"
        per_file[f] += wgt
        per_fn[(f.rsplit("/", 1)[-1], function(line) if line else "?")] += wgt
        if samples:
            per_line[line] += wgt
            why[line].update(samples[i][1])
    total = sum(per_file.values()) or 1.0
    if samples:
        show = lambda n: f"{100 * n / total:6.1f}%"
        print(f"{total:.0f} warp samples over {len(at_line)} instructions")
    else:
        show = lambda n: f"{n:7.0f} {n * 16 / 1024:7.1f} KiB"
        print(f"{total:.0f} instructions with line info ({total * 16 / 1024:.0f} KiB)")
    for f, n in per_file.most_common():
        print(f"{show(n)}  {f}")
    print()
    for (f, fn), n in per_fn.most_common(top):
        print(f"{show(n)}  {f}: {fn}")
    if samples:
        print()
        for line, n in per_line.most_common(top):
            reasons = " ".join(f"{k}:{100 * v / total:.1f}%" for k, v in why[line].most_common(3) if v)
            text = lines[line - 1].strip()[:60] if line else ""
            where = f"{file_of(line).rsplit('/', 1)[-1]}:{function(line)}" if line else "?"
            print(f"{show(n)}  {where}: {text}  [{reasons}]")


if __name__ == "__main__":
    main()
