# Cross-compiling for 64-bit Arm Linux (aarch64) on a Debian x86-64 host with
# Debian's cross compiler (g++-aarch64-linux-gnu) and a sysroot holding the
# arm64 builds of the libraries the project links, as scripts/arm64_test.sh
# prepares it (arm64 .debs extracted, nothing installed system-wide):
#
#   cmake -S . -B build-arm64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
#
# The sysroot is DEEPSEEK_ARM64_SYSROOT (cache variable or environment), by
# default .cache/arm64-sysroot. The C library, libstdc++ and libgomp headers
# come from the cross compiler itself (/usr/aarch64-linux-gnu), which GCC
# searches before the sysroot. Test executables run through qemu-aarch64
# (CMAKE_CROSSCOMPILING_EMULATOR), so gtest_discover_tests and ctest work;
# QEMU_CPU picks the emulated CPU (qemu-user reads it from the environment).

set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(_ds_triple aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${_ds_triple}-gcc)
set(CMAKE_CXX_COMPILER ${_ds_triple}-g++)

if(NOT DEEPSEEK_ARM64_SYSROOT)
  if(DEFINED ENV{DEEPSEEK_ARM64_SYSROOT})
    set(DEEPSEEK_ARM64_SYSROOT "$ENV{DEEPSEEK_ARM64_SYSROOT}")
  else()
    get_filename_component(DEEPSEEK_ARM64_SYSROOT "${CMAKE_CURRENT_LIST_DIR}/../.cache/arm64-sysroot" ABSOLUTE)
  endif()
endif()
set(DEEPSEEK_ARM64_SYSROOT "${DEEPSEEK_ARM64_SYSROOT}" CACHE PATH "arm64 sysroot (extracted Debian arm64 packages)")
if(NOT EXISTS "${DEEPSEEK_ARM64_SYSROOT}/usr/include/hwy")
  message(FATAL_ERROR "No arm64 sysroot at ${DEEPSEEK_ARM64_SYSROOT}: run scripts/arm64_test.sh (or set DEEPSEEK_ARM64_SYSROOT)")
endif()
# Try-compile projects read the toolchain file again: hand them the sysroot.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES DEEPSEEK_ARM64_SYSROOT)

set(CMAKE_SYSROOT "${DEEPSEEK_ARM64_SYSROOT}")
set(CMAKE_LIBRARY_ARCHITECTURE ${_ds_triple})
# find_* and find_package look in the sysroot and the cross compiler's own
# prefix only; programs (pkg-config, qemu) come from the host.
set(CMAKE_FIND_ROOT_PATH "${DEEPSEEK_ARM64_SYSROOT}" /usr/${_ds_triple})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# The host's pkg-config, reading only the sysroot's .pc files (PCRE2).
set(ENV{PKG_CONFIG_DIR} "")
set(ENV{PKG_CONFIG_LIBDIR}
    "${DEEPSEEK_ARM64_SYSROOT}/usr/lib/${_ds_triple}/pkgconfig:${DEEPSEEK_ARM64_SYSROOT}/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_SYSROOT_DIR} "${DEEPSEEK_ARM64_SYSROOT}")

# Shared libraries that the linked ones need (libdnnl.so.2 -> libgomp.so.1 ...)
# are resolved inside the sysroot.
string(APPEND CMAKE_EXE_LINKER_FLAGS_INIT
       " -Wl,-rpath-link,${DEEPSEEK_ARM64_SYSROOT}/usr/lib/${_ds_triple}"
       " -Wl,-rpath-link,${DEEPSEEK_ARM64_SYSROOT}/lib/${_ds_triple}")

find_program(DEEPSEEK_QEMU_AARCH64 qemu-aarch64)
if(DEEPSEEK_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR "${DEEPSEEK_QEMU_AARCH64};-L;${DEEPSEEK_ARM64_SYSROOT}")
endif()
