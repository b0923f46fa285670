#!/bin/bash
# Build, on a CPU machine with PyPI access, what a GPU machine without internet needs for the H200 runs
# (docs/evaluation.md): vLLM 0.26.0 (its CUDA wheel is built for torch 2.11 + CUDA 13, the GPU image's stack),
# pruned of kernels a Hopper GPU does not load (FlashAttention 2, MoE, the Rust frontend, other Pythons'
# deep_gemm), packed as xz parts under 56 MB; the pure dependencies the GPU image lacks, as cp312 wheels
# (bench/gpu/gpu-deps.txt); the tuner's and the plugin's wheels (make gpu-wheels); nginx's Debian package; an
# 8B-shaped model directory (bench/gpu/make_model_dir.py). bench/gpu/setup.sh unpacks it on the GPU machine.
# Usage (from the repository root): bench/gpu/bundle.sh [.gpu]   → .gpu/a (part 1), .gpu/b (part 2), .gpu/c
# (wheels, nginx, the model), .gpu/d (part 3): each under 38 MB, so that one with the working tree (~25 MB,
# tests/fixtures the most of it) stays under a call's 64 MiB.
set -euo pipefail
out=${1:-.gpu}; here=$(cd "$(dirname "$0")" && pwd); work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out/a" "$out/b" "$out/c/whl" "$out/c/debs" "$out/d"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" vllm==0.26.0
(cd "$work" && unzip -q vllm-0.26.0-*.whl -d x && cd x &&
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs &&
  find vllm/third_party/deep_gemm -name "_C.cpython-3*.so" ! -name "*312*" -delete &&
  tar -cf - vllm vllm-0.26.0.dist-info | xz -9 -T2 > "$work/vllm.tar.xz")
split -b 29000000 "$work/vllm.tar.xz" "$work/part."
mv "$work/part.aa" "$out/a/vllm026.part.aa"; mv "$work/part.ab" "$out/b/vllm026.part.ab"
mv "$work/part.ac" "$out/d/vllm026.part.ac"
plat=""
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plat="$plat --platform ${p}_x86_64"
done
while read -r p; do
  [ -z "$p" ] && continue
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d "$out/c/whl" "$p" || echo "could not fetch $p" >&2
done < "$here/gpu-deps.txt"
make gpu-wheels && cp .cache/gpu-wheels/*.whl "$out/c/whl/"
(cd "$out/c/debs" && apt-get download nginx nginx-common 2>/dev/null || apt-get download nginx)
"${PYTHON:-.venv-vllm/bin/python}" "$here/make_model_dir.py" "$out/c/model"  # tokenizers + transformers
du -sh "$out/a" "$out/b" "$out/c"
