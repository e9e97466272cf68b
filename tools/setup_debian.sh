#!/usr/bin/env bash
# Installs what ditscale needs on a fresh Debian 12 machine (run as root or with sudo available),
# creates the Python environment .venv (torch pinned to 2.11.0, the GPU machines' version) and
# configures + builds the C++ tree in build/. Idempotent: a second run only rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
pkgs=(build-essential cmake ninja-build git python3 python3-dev python3-venv python3-pip
      libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev
      libeigen3-dev pybind11-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv --system-site-packages .venv
fi
# matplotlib: the report plots' test; diffusers (pinned) with transformers (its pipelines import
# it): the integration ditscale.diffusers and its tests; pyarrow: Parquet manifests; imageio +
# imageio-ffmpeg: examples/generate.py's MP4 output; accelerate: diffusers' from_pretrained;
# fastapi + uvicorn + pydantic + prometheus-client (+ httpx for its test client): the server;
# av (PyAV): probing and decoding users' media; tensorboard + tqdm: training logs and progress.
echo "== pip install (torch==2.11.0, numpy, pytest, pybind11, scikit-build-core, nvshmem headers, safetensors, matplotlib, diffusers==0.42.1, transformers, pyarrow, imageio)"
.venv/bin/python -m pip install -q --disable-pip-version-check \
  torch==2.11.0 numpy pytest pybind11 scikit-build-core nvidia-nvshmem-cu13 safetensors matplotlib \
  diffusers==0.42.1 transformers==5.24.0 pyarrow==26.0.1 imageio==2.38.2 imageio-ffmpeg==0.8.1 accelerate==1.16.0 \
  fastapi==0.163.2 uvicorn==0.54.0 pydantic==2.14.3 prometheus-client==0.26.0 httpx==0.28.1 \
  av==18.1.0 tensorboard==2.21.0 tqdm==4.70.1
echo "== configure + build (C++ core, CLI, tests, benchmarks; CUDA kernels if nvcc is present)"
cmake -S . -B build -G Ninja -DPython3_EXECUTABLE="$PWD/.venv/bin/python" -DDITSCALE_TORCH=OFF >/dev/null
cmake --build build -j"$(nproc)"
