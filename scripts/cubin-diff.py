#!/usr/bin/env python3
"""Whether two builds' CUDA kernels are the same machine code, without a GPU.

    scripts/cubin-diff.py OLD_KERNELS NEW_KERNELS

Each argument is a kernel cache folder (`$MEGAINFER_CACHE/kernels`) or one .cubin file. Fill
the folders by compiling both trees' kernels into empty caches, e.g.
`MEGAINFER_CACHE=/tmp/old cargo test --release --test cuda_compile` in each tree (the cache
names hash the source, so the two builds' files are matched by content, not by name). A
change meant to leave the code alone (a helper factored out, a comment, a define that is off)
passes (exit code 0) when every CUBIN on one side has one on the other that is byte-identical
or differs only in debug sections (line tables name the tree's path: `cuda_compile`'s
racecheck variant carries them). Unmatched files are paired by name (the same source and
options on both sides), else where each side leaves exactly one of a kernel module, and the
ELF sections that differ are named with their sizes (a `.text.KERNEL` section that differs
means different instructions).
"""

import hashlib
import struct
import sys
from pathlib import Path


def sections(data):
    """The named sections of an ELF64 image: {name: bytes} (NOBITS sections empty)."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, kind, _flags, _addr, off, size, *_ in headers:
        end = data.index(b"\0", names_at + name_off)
        name = data[names_at + name_off:end].decode()
        out[name] = b"" if kind == 8 else data[off:off + size]
    return out


def cubins(arg):
    p = Path(arg)
    files = [p] if p.is_file() else sorted(p.glob("*.cubin"))
    if not files:
        sys.exit(f"{arg}: no .cubin files")
    return {f: f.read_bytes() for f in files}


def module(path):
    """`megakernel-sm_90a` of `megakernel-sm_90a-<hash>.cubin`."""
    return path.stem.rsplit("-", 1)[0]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = cubins(sys.argv[1]), cubins(sys.argv[2])
    digest = lambda b: hashlib.sha256(b).hexdigest()
    old_by, new_by = {}, {}
    for f, b in old.items():
        old_by.setdefault(digest(b), []).append(f)
    for f, b in new.items():
        new_by.setdefault(digest(b), []).append(f)
    only_old = [f for d, fs in old_by.items() if d not in new_by for f in fs]
    only_new = [f for d, fs in new_by.items() if d not in old_by for f in fs]
    same = sum(len(fs) for d, fs in old_by.items() if d in new_by)
    print(f"{same} of {len(old)} old CUBINs have a byte-identical new one ({len(new)} new)")
    pairs = [(a, b) for a in only_old for b in only_new if a.name == b.name]
    for m in sorted({module(f) for f in only_old}):
        a = [f for f in only_old if module(f) == m and all(f != x for x, _ in pairs)]
        b = [f for f in only_new if module(f) == m and all(f != y for _, y in pairs)]
        if len(a) == 1 and len(b) == 1:
            pairs.append((a[0], b[0]))
    ok = len(pairs) == len(only_old) == len(only_new)
    for a, b in pairs:
        sa, sb = sections(old[a]), sections(new[b])
        differ = [n for n in sorted(set(sa) | set(sb)) if sa.get(n) != sb.get(n)]
        code = [n for n in differ if "debug" not in n]
        ok &= not code
        verdict = "differs in debug sections only" if not code else "different code"
        print(f"  {a.name} against {b.name}: {verdict}")
        for n in differ:
            print(f"    {n}: {len(sa.get(n) or b'')} -> {len(sb.get(n) or b'')} bytes")
    for f in only_old:
        if all(f != x for x, _ in pairs):
            print(f"  only old: {f.name}")
    for f in only_new:
        if all(f != y for _, y in pairs):
            print(f"  only new: {f.name}")
    print("same code" if ok else "the code differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
