#!/usr/bin/env bash
# On the GPU machine: unpack the gzipped binaries brought in bundle/bin to /root/bin and keep
# any carried half of the default model in /root/models (see scripts/gpu-check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p /root/bin /root/models
for f in bundle/bin/*.gz; do gunzip -c "$f" > "/root/bin/$(basename "$f" .gz)"; done
chmod +x /root/bin/*
for part in a b; do
  [ -f bundle/model.gguf.part-$part ] && cp bundle/model.gguf.part-$part /root/models/
done
ls /root/bin /root/models
