#!/usr/bin/env bash
# Build the native runtime (native/, CMake) into a git-ignored folder; cmake rebuilds only what changed.
#
#   scripts/native_build.sh                   build/native: libvktrain_native.a, libvktrain.so, vktrain-native-inspect, vktrain-train;
#                                             with the executorch wheel's C++ runtime (include/, lib/libexecutorch.so):
#                                             libvktrain_executorch_backend.so and vktrain-executorch-train (native/executorch)
#   scripts/native_build.sh --sanitize        build/native-asan: the same with AddressSanitizer + UBSan
#   scripts/native_build.sh --cross aarch64   build/native-aarch64: cross-built (scripts/native_cross_build.sh)
#
# Needs cmake, g++, flatc + the flatbuffers headers, the Vulkan headers + loader (scripts/setup.sh installs them
# on Debian) and executorch's program.fbs, found in the executorch wheel of $NATIVE_PYTHON (default .venv/bin/python).
# Quiet when there is nothing to do; on failure prints the build log's tail and names what is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

build=build/native
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
case "${1:-}" in
  "") ;;
  --sanitize) build=build/native-asan; cmake_args+=(-DVKTRAIN_SANITIZE=ON) ;;
  --cross)
    [ "${2:-}" = aarch64 ] || { echo "native build: --cross takes aarch64" >&2; exit 2; }
    build=build/native-aarch64; cmake_args+=(-DCMAKE_TOOLCHAIN_FILE="$root/native/cmake/aarch64-linux-gnu.cmake") ;;
  *) echo "native build: unknown argument ${1} (expected --sanitize or --cross aarch64)" >&2; exit 2 ;;
esac

missing=()
command -v cmake >/dev/null || missing+=("cmake (Debian: cmake)")
command -v flatc >/dev/null || missing+=("flatc (Debian: flatbuffers-compiler)")
[ -f /usr/include/flatbuffers/flatbuffers.h ] || missing+=("the flatbuffers headers (Debian: libflatbuffers-dev)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'native build: missing %s\n' "${missing[@]}" >&2
  echo "native build: run scripts/setup.sh as root, or install them yourself" >&2
  exit 1
fi

py="${NATIVE_PYTHON:-$root/.venv/bin/python}"
schema_dir="$("$py" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("executorch")  # locates the wheel without importing it
sys.exit("executorch is not installed for " + sys.executable) if spec is None else None
print(os.path.join(list(spec.submodule_search_locations)[0], "schema"))')" ||
  { echo "native build: cannot find executorch's program.fbs through $py (run scripts/setup.sh)" >&2; exit 1; }
cmake_args+=(-DVKTRAIN_EXECUTORCH_SCHEMA_DIR="$schema_dir")

mkdir -p "$build"
log="$build/build.log"
if ! { cmake -S native -B "$build" "${cmake_args[@]}" && cmake --build "$build" -j "${NATIVE_JOBS:-2}"; } >"$log" 2>&1; then
  grep -E "error|Error|not found|missing" "$log" | head -20 >&2 || true
  tail -15 "$log" >&2
  echo "native build: failed in $build (full log: $log)" >&2
  exit 1
fi
