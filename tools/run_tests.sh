#!/usr/bin/env bash
# Runs every CPU test of ditscale: sets up (tools/setup_debian.sh), runs the C++ suites through
# CTest, installs the Python package with `pip install .` (pybind11 core + PyTorch extension) and
# runs pytest. GPU tests skip cleanly on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_debian.sh
echo "== ctest"
ctest --test-dir build --output-on-failure -j"$(nproc)"
echo "== pip install . (scikit-build-core over the same CMake project)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation .
echo "== pytest"
export DITSCALE_CLI="$PWD/build/tools/ditscale"  # the CLI tests run it, never skip
cd tests/python && ../../.venv/bin/python -m pytest -q -p no:cacheprovider .
