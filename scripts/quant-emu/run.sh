#!/usr/bin/env bash
# Runs kernels/quant/quant.cu's mat-vecs and element decoder on the CPU: the kernel source,
# with its inline PTX (loads, prefetches, PDL, f16 conversion) replaced by plain C++, is
# compiled by g++ against shim.h, which runs a thread block as 256 threads with barriers for
# __syncthreads and the warp shuffles. main.cpp compares every type (Q8_0, Q4_0, Q4_1), input
# mode (plain, RMS-normed, SiLU·up) and accumulate flag, on row lengths that end part-way
# through the kernel's 256-element chunks, with f64 sums of the GGUF-decoded values.
# Checks the kernel's indexing and arithmetic without a GPU; not its speed or its PTX.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 - "$here/../../kernels/quant/quant.cu" "$out/quant_emu.h" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r'__device__ __forceinline__ float q_f16\(q_u16 h\) \{.*?\n\}',
           '__device__ __forceinline__ float q_f16(q_u16 h) { return emu_f16(h); }', s, flags=re.S)
s = s.replace('extern __shared__ float4 qg_xs4[];', 'float4* qg_xs4 = g_dyn;')
s = re.sub(r'asm volatile\("griddepcontrol[^;]*;" ::: "memory"\);', '', s)
s = re.sub(r'asm volatile\("prefetch[^;]*;"\s*::"l"\([^;]*\)\);', ';', s)
s = s.replace('asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));',
              'memcpy(&r, p, 8);')
s = s.replace('asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r.x) : "l"(p));',
              'memcpy(&r.x, p, 4);')
s = s.replace('extern "C" ', '')
if 'asm' in s:
    sys.exit('quant.cu has inline PTX this script does not replace: extend it')
open(sys.argv[2], 'w').write(s)
PY
g++ -std=c++20 -O1 -pthread -I"$out" -o "$out/emu" "$here/main.cpp"
"$out/emu"
