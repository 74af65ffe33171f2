# Cross-build for 64-bit ARM Linux with Debian's g++-aarch64-linux-gnu and libvulkan-dev:arm64 (multiarch:
# the arm64 libraries live in /usr/lib/aarch64-linux-gnu; the headers, flatc and the header-only flatbuffers
# are the host's). scripts/native_cross_build.sh installs the packages and builds with it.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Libraries only from the target's multiarch folder, never the host's; programs (flatc) from the host.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu /)
