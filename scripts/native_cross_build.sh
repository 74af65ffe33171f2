#!/usr/bin/env bash
# Cross-build the native runtime for aarch64 Linux (build only; CI runs it): Debian's g++-aarch64-linux-gnu and
# libvulkan-dev:arm64 (multiarch), installed when missing (as root, quietly), then
# scripts/native_build.sh --cross aarch64 into build/native-aarch64. Checks that the inspector is an ARM64 ELF.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

debs=(g++-aarch64-linux-gnu libvulkan-dev:arm64)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "native cross build: missing Debian packages: ${missing[*]}" >&2
    echo "native cross build: run as root, or: sudo dpkg --add-architecture arm64 && sudo apt-get update &&" \
         "sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "native cross build: installing ${missing[*]} (the arm64 architecture is added to dpkg)"
  export DEBIAN_FRONTEND=noninteractive
  dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { echo "native cross build: apt-get install ${missing[*]} failed" >&2; exit 1; }
fi

scripts/native_build.sh --cross aarch64
binary=build/native-aarch64/vktrain-native-inspect
if ! od -An -t x1 -j 18 -N 2 "$binary" | grep -q "b7 00"; then  # ELF e_machine 0xB7 = EM_AARCH64
  echo "native cross build: $binary is not an aarch64 executable" >&2
  exit 1
fi
