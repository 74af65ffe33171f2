#!/usr/bin/env bash
# The README's test command: set up (idempotent), build the SPIR-V cache, run the whole suite on the
# Vulkan device (lavapipe when there is no GPU) with the validation layer on.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export VKTRAIN_VALIDATION="${VKTRAIN_VALIDATION:-1}"
if [ -f vktrain/runtime_shaders/build.py ]; then
  .venv/bin/python -m vktrain.runtime_shaders.build
fi
exec .venv/bin/python -m pytest -q "$@"
