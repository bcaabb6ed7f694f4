#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): what compile
# variants of the megakernel (VARIANTS="LABEL:DEFINES ...", DEFINES comma-separated, run as
# bundle/megainfer with MEGAINFER_MK_DEFINES) do to a mat-vec's own time, on each preset of
# PRESETS (default Llama-3.2-3B): per variant, the step's ms/token unprofiled (`bench --preset
# NAME --reps 3 --paths megakernel`, 32 + 128 tokens) and a profiled step with the tile stamps
# (`-DMK_TILE_STAMPS=1`, `--profile --timeline`, 20 new tokens) through
# `scripts/timeline.py --tiles`: per kind, prepared -> first page, warp 0's tiles, the other
# warps, post (µs, medians). The variant "default" (no defines) always runs first.
# E.g. whether the tile loops' code size sets the consumers' rate:
#   VARIANTS="u1:-DMK_XS_UNROLL=1,-DMK_X_REG_STEPS_BF16=0 xreg8:-DMK_X_REG_STEPS_BF16=8"
# Run as: TESTS=" " VARIANTS=... EXTRA="bash scripts/bench-tile-variants.sh" bash scripts/gpu-check.sh
. "$(dirname "$0")/bench-rows.sh"
for P in ${PRESETS:-llama-3.2-3b}; do
  for V in default: ${VARIANTS:-}; do
    label=${V%%:*} defs=${V#*:}
    defs=${defs//,/ }
    r "$P $label" MEGAINFER_MK_DEFINES="$defs" bundle/megainfer bench --preset "$P" --reps 3 --paths megakernel
    csv="$OUT/tiles-$P-$label.csv"
    MEGAINFER_MK_DEFINES="-DMK_TILE_STAMPS=1 $defs" bundle/megainfer bench --preset "$P" --gen 20 --reps 1 \
      --paths megakernel --profile --timeline "$csv" > "$OUT/b.log" 2>&1
    if [ -f "$csv" ]; then
      python3 scripts/timeline.py --tiles "$csv" | sed -n '/^tiles/,$p' | sed "s/^/$P $label: /"
      rm -f "$csv"
    else
      echo "$P $label: no timeline; $(tail -1 "$OUT/b.log")"
    fi
  done
done
rm -f "$OUT/b.log"
