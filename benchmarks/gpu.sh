#!/usr/bin/env bash
# The side-by-side comparison on this host's accelerators, ~8 GiB state (issue 6):
#
#   bash benchmarks/gpu.sh [OUT_FILE]        (default: benchmarks/results/gpu.md)
#
# Needs jax with its accelerator plugin and the project's dependencies importable (the
# package itself is taken from this checkout). RUNS=3 for fewer timed rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu.md}
python3 -c 'import jax, orbax.checkpoint as o; print("jax", jax.__version__, "orbax", o.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 benchmarks/compare.py --gpu --runs "${RUNS:-5}" --out "$out"
