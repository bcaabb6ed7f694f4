#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): whether the page
# waits' mbarrier.try_wait (which may suspend the thread) costs the step. First
# scripts/mbar-wake.cu (nvcc on the machine): how much later a suspended try_wait returns than
# a polling test_wait after a bulk copy, HBM idle and busy. Then, on each preset of PRESETS
# (default Llama-3.2-1B and Llama-3.2-3B; `bench --preset P --reps 3 --paths megakernel`,
# ROUNDS rounds, default 2), the default kernel against `-DMK_PAGE_SPIN=3` (the consumers'
# page waits poll), `=1` (every page wait), the loader bounded at BOUND tiles in flight
# (default 8; `-DMK_INFLIGHT=8 -DMK_INFLIGHT_STREAM=8`, 2.7-8.5% slower than the whole ring at
# any bound from 6 to 11, BENCHMARKS.md 2026-11-29) and the same with its waits polling
# (`-DMK_PAGE_SPIN=2`). Llama-1B's variants keep its `-DMK_L2_PF_NEXT=8`, which the host drops
# when a define bounds the loader. Compile the variants beforehand with the carried binary
# (`MEGAINFER_MK_DEFINES=... megainfer schedule --preset P --context 161 --compile-kernels
# h200`), or each costs an NVRTC compile here.
# Run as: TESTS=" " EXTRA="bash scripts/bench-page-waits.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
if nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/mw scripts/mbar-wake.cu > "$OUT/mw-build.log" 2>&1; then
  /tmp/mw
else
  echo "mbar-wake.cu did not build:"
  tail -5 "$OUT/mw-build.log"
fi
B=${BOUND:-8}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for P in ${PRESETS:-llama-3.2-1b llama-3.2-3b}; do
    a=(bench --preset "$P" --reps 3 --paths megakernel)
    pf=""
    [ "$P" = llama-3.2-1b ] && pf=" -DMK_L2_PF_NEXT=8"
    r "$P default" bundle/megainfer "${a[@]}"
    r "$P consumers' page waits poll" MEGAINFER_MK_DEFINES="-DMK_PAGE_SPIN=3" bundle/megainfer "${a[@]}"
    r "$P every page wait polls" MEGAINFER_MK_DEFINES="-DMK_PAGE_SPIN=1" bundle/megainfer "${a[@]}"
    r "$P $B in flight" MEGAINFER_MK_DEFINES="-DMK_INFLIGHT=$B -DMK_INFLIGHT_STREAM=$B$pf" bundle/megainfer "${a[@]}"
    r "$P $B in flight, the loader's waits poll" \
      MEGAINFER_MK_DEFINES="-DMK_INFLIGHT=$B -DMK_INFLIGHT_STREAM=$B$pf -DMK_PAGE_SPIN=2" bundle/megainfer "${a[@]}"
  done
done
rm -f "$OUT/b.log"
