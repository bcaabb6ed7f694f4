#!/usr/bin/env bash
# The GPU's clocks while a command runs: scripts/sample-clocks.sh CMD...
# Samples nvidia-smi every 250 ms during CMD (its output goes on as usual), then prints how
# often each SM clock was seen while the GPU drew more than LOAD_W watts (default 400: a
# decode's kernels, not the host's weight generation between them), with the memory clock and
# the highest power and temperature seen. E.g. whether a bench ran at the boost clock:
#   scripts/sample-clocks.sh bundle/megainfer bench --preset llama-3.1-8b --gen 1000
set -uo pipefail
log=$(mktemp)
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits \
  -lms 250 > "$log" 2>&1 &
smi=$!
"$@"
rc=$?
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null
awk -F', ' -v w="${LOAD_W:-400}" '
  $3 + 0 > w { n++; sm[$1]++; mem[$2]++; if ($3 > pw) pw = $3; if ($4 > t) t = $4 }
  END {
    if (!n) { print "clocks: no sample above " w " W"; exit }
    printf "clocks over %d samples above %d W: SM MHz", n, w
    for (c in sm) printf " %s:%d", c, sm[c]
    printf "; memory MHz"
    for (c in mem) printf " %s:%d", c, mem[c]
    printf "; at most %s W, %s C\n", pw, t
  }' "$log"
rm -f "$log"
exit "$rc"
