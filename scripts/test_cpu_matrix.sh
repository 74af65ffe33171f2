#!/usr/bin/env bash
# The parity tests (Vulkan runner and exported programs vs eager PyTorch) under every CPU setting that
# changes floating-point results: PyTorch's CPU kernels forced to lower ISAs (ATEN_CPU_CAPABILITY) and
# lavapipe at both vector widths (LP_NATIVE_VECTOR_WIDTH). Their tolerances must not depend on the CPU,
# so each combination must pass. Extra pytest arguments are passed on (e.g. -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export VKTRAIN_VALIDATION="${VKTRAIN_VALIDATION:-1}"
.venv/bin/python -m vktrain.runtime_shaders.build >/dev/null
tests=(tests/test_runner_parity.py tests/test_llama_parity.py tests/test_export.py tests/test_llama.py
       tests/test_adapters_and_isolation.py)
# The files spread over the CPU's cores as in scripts/test.sh.
workers="${VKTRAIN_TEST_WORKERS:-$(nproc)}"
[ "$workers" -gt 4 ] && workers=4
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
failed=()
for isa in default avx2; do
  for width in 128 256; do
    echo "== ATEN_CPU_CAPABILITY=$isa LP_NATIVE_VECTOR_WIDTH=$width"
    if ! ATEN_CPU_CAPABILITY=$isa LP_NATIVE_VECTOR_WIDTH=$width \
         .venv/bin/python -m pytest -q -p no:cacheprovider -W ignore "${parallel[@]}" "${tests[@]}" "$@" | tail -n 3; then
      failed+=("ATEN_CPU_CAPABILITY=$isa LP_NATIVE_VECTOR_WIDTH=$width")
    fi
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'cpu matrix: failed under %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "cpu matrix: all 4 settings passed"
