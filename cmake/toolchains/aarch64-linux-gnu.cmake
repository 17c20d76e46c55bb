# Cross-compiling for aarch64 Linux with Debian's cross toolchain (g++-aarch64-linux-gnu)
# and its arm64 multiarch libraries (libhwloc-dev:arm64, libgtest-dev:arm64); programs
# run under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR), so ctest runs the tests emulated.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Debian's multiarch layout: target libraries in /usr/lib/aarch64-linux-gnu, headers in
# /usr/include (shared) and /usr/include/aarch64-linux-gnu; pkg-config reads the arm64 .pc.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
# The cross toolchain's ld.so (libc6-arm64-cross) must load its own libc: once arm64
# multiarch packages are installed, the host ld.so.cache points at libc6:arm64, a different
# glibc build whose private loader layout differs (first pthread_create then spins forever).
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu;-E;LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)
