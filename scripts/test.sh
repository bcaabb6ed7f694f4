#!/usr/bin/env bash
# The project's test command (CI runs exactly this): every test that runs without a GPU,
# including tests/cuda_compile.rs, which compiles the CUDA sources with NVRTC. NVRTC and the
# CUDA headers come from NVIDIA's PyPI wheels, installed once into target/nvrtc-wheel; no GPU,
# driver or CUDA toolkit is needed. GPU tests are #[ignore = "needs a GPU"] and are listed as
# ignored here; scripts/gpu-check.sh runs them on a GPU machine.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh --test hf`).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=target/nvrtc-wheel
NV="$PWD/$WHEELS/nvidia/cu13"
# 13.x: the version cudarc's cuda-13000 feature binds; the runtime wheel carries cuda_bf16.h
# and the other headers that the kernels include.
PKGS=(nvidia-cuda-nvrtc==13.5.37 nvidia-cuda-runtime==13.5.37)
if [ ! -f "$WHEELS/.installed" ] || [ "$(cat "$WHEELS/.installed")" != "${PKGS[*]}" ]; then
  rm -rf "$WHEELS"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$WHEELS" "${PKGS[@]}"
  echo "${PKGS[*]}" > "$WHEELS/.installed"
fi
[ -f "$NV/lib/libnvrtc.so.13" ] && [ -f "$NV/include/cuda_bf16.h" ] || {
  echo "scripts/test.sh: NVRTC wheel incomplete under $NV" >&2
  exit 1
}

export LD_LIBRARY_PATH="$NV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_HOME="$NV"
cargo test --release --workspace "$@"
