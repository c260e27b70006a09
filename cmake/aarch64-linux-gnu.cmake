# Cross-build for 64-bit Arm Linux with Debian's toolchain (g++-aarch64-linux-gnu)
# and arm64 packages (dpkg --add-architecture arm64; libhwy-dev:arm64, ...).
# Test programs run under qemu-user-static (`make test-aarch64`).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Headers and libraries from the arm64 packages only; programs from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# CTest (and gtest_discover_tests at build time) runs the programs through qemu.
# `-L /`: the arm64 loader and libraries of the multiarch packages (/lib/aarch64-linux-gnu);
# the cross toolchain's own copy under /usr/aarch64-linux-gnu mixed with them hangs.
find_program(LEANSTEP_QEMU_AARCH64 NAMES qemu-aarch64-static qemu-aarch64 REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR ${LEANSTEP_QEMU_AARCH64};-L;/)
