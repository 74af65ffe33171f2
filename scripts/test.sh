#!/usr/bin/env bash
# The README's test command: set up (idempotent), build the SPIR-V cache, run the whole suite on the
# Vulkan device (lavapipe when there is no GPU) with the validation layer on, one worker per core (up to 4).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export VKTRAIN_VALIDATION="${VKTRAIN_VALIDATION:-1}"
if [ -f vktrain/runtime_shaders/build.py ]; then
  .venv/bin/python -m vktrain.runtime_shaders.build
fi
# Test files spread over the CPU's cores (pytest-xdist; a file's tests stay in one worker, so its module
# fixtures are built once); VKTRAIN_TEST_WORKERS=0 runs them in this process.
workers="${VKTRAIN_TEST_WORKERS:-$(nproc)}"
[ "$workers" -gt 4 ] && workers=4  # each worker holds a Vulkan device and up to ~2 GB
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadfile "$@"; fi
exec .venv/bin/python -m pytest -q "$@"
