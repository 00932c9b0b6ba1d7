// Which instruction sets this CPU offers, asked at run time: the library is compiled for
// baseline x86-64 and only its kernels for their instruction sets, so these can be asked
// on any CPU.
#pragma once

inline bool avx512_bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

inline bool avx2_fma_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
