# Sourced by the scripts/bench-*.sh that time sampled rules on the GPU machine: r LABEL [VAR=VALUE ...] CMD ...
# runs CMD (a `megainfer bench`) under env, its log in $OUT/b.log, and prints LABEL, its table rows' path, median,
# range and share of the read bandwidth, bench's count of tokens identical between paths (where it
# timed two), the in-launch draws' search counts (and those decided by the top token
# alone) where it printed them, and its first error.
r() { local label=$1; shift; env "$@" > $OUT/b.log 2>&1; echo "$label: $(grep -E "^\| (megakernel|graph)" $OUT/b.log | cut -d'|' -f2,3,4,7 | tr -s ' ' | tr '\n' ' ') $(grep -o 'tokens identical for [0-9/]*' $OUT/b.log | tr '\n' ' ')$(grep -m1 "searched" $OUT/b.log | sed 's/.*: \([0-9]* of [0-9]*\) draws.*(\(.*\)); the.*attempt\(, \([0-9]*\) of them.*\)\{0,1\}$/\1 searched (\2), top token alone \4/') $(grep -m1 -i -E "error|panick" $OUT/b.log)"; }
