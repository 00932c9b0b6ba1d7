// Which instruction sets this CPU offers, asked at run time: the library is compiled for
// baseline x86-64 and only its kernels for their instruction sets, so these can be asked
// on any CPU.
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <string>

// The AMX paths need Linux (which hands out the tile state on request) and a compiler
// that knows the tile instructions; elsewhere they are left out and the vector paths serve.
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                           (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define LONGSPEC_HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LONGSPEC_HAS_AMX 0
#endif

inline bool avx512_bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

inline bool avx2_fma_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// The tile instructions' CPUID bits (leaf 7, EDX): 22 bf16 products, 24 the tiles, 25 int8
// products; and Linux's permission for this process to use the tile state
// (ARCH_REQ_XCOMP_PERM for XTILEDATA). Asked once: CPUID traps to the hypervisor in a VM
// (tens of microseconds here), too slow to ask per product.
inline bool amx_granted_now(unsigned feature_bit) {
#if LONGSPEC_HAS_AMX
  unsigned a = 0, b = 0, c = 0, d = 0;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl") ||
      !__get_cpuid_count(7, 0, &a, &b, &c, &d))
    return false;
  if (!((d >> 24) & 1u) || !((d >> feature_bit) & 1u)) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  (void)feature_bit;
  return false;
#endif
}

// LONGSPEC_AMX=0 keeps every kernel on its vector path (read once per process, like the
// rest: a process never mixes the paths' roundings).
inline bool amx_allowed() {
  const char* value = std::getenv("LONGSPEC_AMX");
  return value == nullptr || std::string(value) != "0";
}

inline bool amx_bf16_supported() {
  static const bool granted = amx_allowed() && amx_granted_now(22);
  return granted;
}

inline bool amx_int8_supported() {
  static const bool granted = amx_allowed() && amx_granted_now(25);
  return granted;
}

#if LONGSPEC_HAS_AMX
// The tile configuration (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC does not see that ldtilecfg reads the configuration and drops the stores that fill
// it (every tile then has 0 rows and the first tile instruction faults); the compiler
// barrier keeps them.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& config) {
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif
