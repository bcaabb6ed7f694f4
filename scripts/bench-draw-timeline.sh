#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-check.sh unpacked bundle/ (OUT set): where the end of a
# step goes, greedy against the draw inside the launch (T 0.8 top-p 0.95; with WARM=1 also
# drawn twice, the first thrown away; and pure temperature), from per-instruction timelines
# with the draw's stamps (SMP_STAMPS, default -DMK_SMP_STAMPS=1; =2 adds the draw's phases),
# summarised by scripts/draw-timeline.py, for each preset of PRESETS (default: SmolLM2 and
# Llama-1B), or with MODEL=FILE for that model (37-token prompt; PRESETS=default names its rows).
# Run as: TESTS=" " EXTRA="bash scripts/bench-draw-timeline.sh" bash scripts/gpu-check.sh
N=bundle/megainfer
IL=MEGAINFER_MK_DRAW_IN_LAUNCH=1
S=${SMP_STAMPS:--DMK_SMP_STAMPS=1}
for P in ${PRESETS:-smollm2-135m llama-3.2-1b}; do
  SRC="--preset $P"
  [ -n "${MODEL:-}" ] && SRC="-m $MODEL --prompt-len 37"
  B="bench $SRC --paths megakernel --reps 1 --gen 32 --profile"
  t() {  # t NAME DEFINES [ENV...] -- BENCH OPTIONS
    local name=$1 d=$2; shift 2
    env MEGAINFER_MK_DEFINES="$d" "$@" --timeline $OUT/tl-$P-$name.csv > $OUT/b-$P-$name.log 2>&1
    echo "$P $name: $(grep -E "^\| megakernel" $OUT/b-$P-$name.log | cut -d'|' -f3) $(grep -m1 -i -E "error|panick" $OUT/b-$P-$name.log)"
  }
  t greedy "$S" $N $B
  t topp "$S" $IL $N $B --temperature 0.8 --top-p 0.95
  [ "${WARM:-0}" = 1 ] && t topp-warm "$S -DMK_SMP_WARM=1" $IL $N $B --temperature 0.8 --top-p 0.95
  t t1 "$S" $IL $N $B --temperature 1.0
  python3 scripts/draw-timeline.py greedy=$OUT/tl-$P-greedy.csv top-p=$OUT/tl-$P-topp.csv \
    $([ "${WARM:-0}" = 1 ] && echo top-p,warm=$OUT/tl-$P-topp-warm.csv) T1=$OUT/tl-$P-t1.csv
done
rm -f $OUT/b-*.log
tar -czf $OUT/timelines.tar.gz -C $OUT $(cd $OUT && ls tl-*.csv) && rm -f $OUT/tl-*.csv
