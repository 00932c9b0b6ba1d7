// Products with GGUF's quantized weights as the file stores them: y = x . W^T for W in
// Q8_0, Q5_0, Q4_K or Q6_K, the formats llama.cpp's Q8_0 and Q4_K_M files are made of.
//
// Why: a decode step streams every weight once; the file's 4.5-8.5 bits a weight are a
// quarter to a half of the bytes of the bf16 copy a dequantizing load made.
//
// Exactness: each row of x is quantized on its own, to int8 codes with one float32 scale
// per 32 values (`quantize_row`: IEEE operations whose vector forms give the same bits).
// Every block's dot product is an exact integer sum; every output is then one float32
// sum over the weight's blocks in block order, each block's term added by one fused
// multiply-add (`Format::term` below, mirrored lane for lane by the vector paths). So an
// output row is the same bits whatever the other rows of the call, whatever the thread
// count, and on every instruction set: AVX-512 VNNI, AVX2 and the portable loop.
//
// Layout: the file's rows are repacked once at load (`gguf_repack`) into groups of 16
// rows. Per group and 32-value block, 4-value runs of the 16 rows are interleaved, so one
// 64-byte load gives each of 16 lanes (rows) the codes of 4 consecutive values, which
// `vpdpbusd` (u8 codes x s8 activations) sums into that lane: no reduction across lanes.
// AVX-512 runs two neighbouring groups a pass over the blocks (a row's broadcasts and scale
// shared), or one for up to 16 rows of a weight streamed from memory (the output layer: one
// stream of addresses a thread), and unpacks a block's codes once for every row of the call. Repacked
// weights of 2 MiB or more lie on transparent huge pages.
// The same bits as the file's, rearranged; scales stay fp16 and 6-bit scales become bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kLanes = 16;  // rows per group
constexpr int64_t kBlock = 32;  // values per activation block (and per Q8_0 / Q5_0 block)
constexpr int64_t kRowTile = 4; // rows of x per pass over a group's weights

// The instruction sets a product can run on (every one gives the same bits).
enum class Path { kPortable, kAvx2, kAvx512Vnni };

// GGML's type ids.
enum Kind : int64_t { kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

// ---------------------------------------------------------------- repacked layouts
// Bytes of one group record per 32-value block (Q4_K, Q6_K: per 256-value superblock).
// Q8_0: d fp16[16] | codes [8 runs][16 lanes][4] (s8)
// Q5_0: d fp16[16] | high bits [16 lanes][4] (byte j: bit r = 5th bit of value 4r + j) | nibbles [4][16][4]
// Q4_K: d fp16[16] | dmin fp16[16] | sc u8[8][16] | m u8[8][16] | per 32-block: nibbles [4][16][4]
// Q6_K: d fp16[16] | sc s8[16][16] | per 32-block: nibbles [4][16][4] | high pairs [2][16][4]
// Nibbles: vector v, lane i, byte j: low nibble = value 8v + j, high = value 8v + 4 + j.
// Q6_K high pairs: vector h, lane i, byte j, bits 2s..2s+1 = high bits of value 16h + 4s + j.
constexpr int64_t kQ8Record = 32 + 512;
constexpr int64_t kQ5Record = 32 + 64 + 256;
constexpr int64_t kQ4KRecord = 64 + 256 + 8 * 256;
constexpr int64_t kQ6KRecord = 32 + 256 + 8 * (256 + 128);

int64_t super_values(int64_t kind) { return kind == kQ4_K || kind == kQ6_K ? 256 : 32; }

int64_t record_bytes(int64_t kind) {
  switch (kind) {
    case kQ8_0: return kQ8Record;
    case kQ5_0: return kQ5Record;
    case kQ4_K: return kQ4KRecord;
    case kQ6_K: return kQ6KRecord;
  }
  TORCH_CHECK(false, "unsupported GGML type ", kind);
}

int64_t file_block_bytes(int64_t kind) {
  switch (kind) {
    case kQ8_0: return 34;
    case kQ5_0: return 22;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
  }
  TORCH_CHECK(false, "unsupported GGML type ", kind);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int64_t nibble_at(int64_t v, int64_t lane, int64_t j) { return v * 64 + lane * 4 + j; }

// Codes 0..15 of a 32-value block into the nibble layout.
void put_nibbles(uint8_t* out, int64_t lane, const uint8_t* codes) {
  for (int64_t e = 0; e < 32; ++e) {
    const int64_t v = e / 8, j = e % 8;
    uint8_t& byte = out[nibble_at(v, lane, j % 4)];
    byte = j < 4 ? uint8_t((byte & 0xF0) | (codes[e] & 0x0F)) : uint8_t((byte & 0x0F) | ((codes[e] & 0x0F) << 4));
  }
}

// One file row (all its blocks) of lane `lane` into the group record `group`.
void repack_row(int64_t kind, const uint8_t* row, int64_t K, int64_t lane, uint8_t* group) {
  const int64_t supers = K / super_values(kind), rec = record_bytes(kind), fb = file_block_bytes(kind);
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * fb;
    uint8_t* r = group + s * rec;
    uint8_t codes[256];
    if (kind == kQ8_0) {
      std::memcpy(r + 2 * lane, b, 2);
      for (int64_t e = 0; e < 32; ++e) r[32 + (e / 4) * 64 + lane * 4 + e % 4] = b[2 + e];
    } else if (kind == kQ5_0) {
      std::memcpy(r + 2 * lane, b, 2);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int64_t e = 0; e < 32; ++e) {
        codes[e] = e < 16 ? (b[6 + e] & 0x0F) : (b[6 + e - 16] >> 4);
        if ((qh >> e) & 1u) r[32 + lane * 4 + e % 4] |= uint8_t(1u << (e / 4));
      }
      put_nibbles(r + 96, lane, codes);
    } else if (kind == kQ4_K) {
      std::memcpy(r + 2 * lane, b, 2);
      std::memcpy(r + 32 + 2 * lane, b + 2, 2);
      const uint8_t* sc = b + 4;
      for (int64_t j = 0; j < 8; ++j) {
        const uint8_t scale = j < 4 ? (sc[j] & 63) : ((sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4));
        const uint8_t minimum = j < 4 ? (sc[j + 4] & 63) : ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
        r[64 + j * 16 + lane] = scale;
        r[192 + j * 16 + lane] = minimum;
      }
      const uint8_t* qs = b + 16;
      for (int64_t e = 0; e < 256; ++e) {
        const int64_t c = e / 64, high = (e % 64) / 32, i = e % 32;
        codes[e] = high ? (qs[32 * c + i] >> 4) : (qs[32 * c + i] & 0x0F);
      }
      for (int64_t j = 0; j < 8; ++j) put_nibbles(r + 320 + j * 256, lane, codes + 32 * j);
    } else {  // Q6_K
      const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
      std::memcpy(r + 2 * lane, b + 208, 2);
      for (int64_t t = 0; t < 16; ++t) r[32 + t * 16 + lane] = sc[t];
      uint8_t high[256];
      for (int64_t e = 0; e < 256; ++e) {
        const int64_t h = e / 128, rest = e % 128;
        codes[e] = rest < 64 ? (ql[64 * h + rest] & 0x0F) : (ql[64 * h + rest - 64] >> 4);
        high[e] = (qh[32 * h + rest % 32] >> (2 * (rest / 32))) & 3;
      }
      for (int64_t j = 0; j < 8; ++j) {
        uint8_t* blk = r + 288 + j * 384;
        put_nibbles(blk, lane, codes + 32 * j);
        for (int64_t e = 0; e < 32; ++e) {
          const int64_t g = e / 4;
          blk[256 + (g / 4) * 64 + lane * 4 + e % 4] |= uint8_t(high[32 * j + e] << (2 * (g % 4)));
        }
      }
    }
  }
}

// A zeroed [rows, cols] uint8 tensor; from 2 MiB on, on its own anonymous mapping advised for
// transparent huge pages (Linux's default "madvise" policy): a product streams the weight once
// a call, and with 4 KiB pages that stream takes a TLB miss every 4 KiB.
at::Tensor huge_zeros(int64_t rows, int64_t cols) {
  constexpr int64_t kHuge = int64_t(2) << 20;
  const int64_t bytes = rows * cols;
  if (bytes >= kHuge) {
    const int64_t mapped = (bytes + 2 * kHuge - 1) / kHuge * kHuge;
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      uint8_t* start = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~uintptr_t(kHuge - 1));
#ifdef MADV_HUGEPAGE
      madvise(start, mapped - (start - static_cast<uint8_t*>(base)), MADV_HUGEPAGE);  // a refusal leaves 4 KiB pages
#endif
      return at::from_blob(start, {rows, cols}, [base, mapped](void*) { munmap(base, mapped); }, at::TensorOptions().dtype(at::kByte));
    }
  }
  return at::zeros({rows, cols}, at::TensorOptions().dtype(at::kByte));
}

// raw: the file's [N, row bytes] uint8 tensor. Rows past N stay zero (zero scales).
at::Tensor repack(const at::Tensor& raw, int64_t kind, int64_t K) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "raw: contiguous uint8 [N, row bytes]");
  const int64_t sv = super_values(kind);
  TORCH_CHECK(K > 0 && K % sv == 0, "GGML type ", kind, " needs rows of a multiple of ", sv, " values, got ", K);
  const int64_t N = raw.size(0), row_bytes = K / sv * file_block_bytes(kind);
  TORCH_CHECK(raw.size(1) == row_bytes, "rows of ", raw.size(1), " bytes where GGML type ", kind, " with ", K,
              " values needs ", row_bytes);
  const int64_t groups = (N + kLanes - 1) / kLanes, group_bytes = K / sv * record_bytes(kind);
  at::Tensor out = huge_zeros(groups, group_bytes);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t i = 0; i < kLanes && g * kLanes + i < N; ++i)
        repack_row(kind, src + (g * kLanes + i) * row_bytes, K, i, dst + g * group_bytes);
  });
  return out;
}

// ---------------------------------------------------------------- activations
// One row quantized: codes, one scale per 32 values, and each 16 values' code sum.
struct Act {
  const int8_t* q;
  const float* d;
  const int32_t* sums;  // [2 * blocks]
};

struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
  int64_t K = 0, blocks = 0;
  Act row(int64_t m) const { return {q.data() + m * K, d.data() + m * blocks, sums.data() + m * 2 * blocks}; }
};

// d = amax / 127, codes = round-half-even(x * (1 / d)): IEEE operations in this order on
// every CPU (compiled for baseline x86-64), so a row's codes are the same bits anywhere.
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float v[kBlock], amax = 0.0f;
    for (int64_t e = 0; e < kBlock; ++e) {
      v[e] = static_cast<float>(x[b * kBlock + e]);
      amax = std::fmax(amax, std::fabs(v[e]));
    }
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    d[b] = scale;
    int32_t low = 0, high = 0;
    for (int64_t e = 0; e < kBlock; ++e) {
      float r = std::nearbyint(v[e] * inverse);
      r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
      q[b * kBlock + e] = static_cast<int8_t>(r);
      (e < 16 ? low : high) += static_cast<int32_t>(r);
    }
    sums[2 * b] = low;
    sums[2 * b + 1] = high;
  }
}

// ---------------------------------------------------------------- the portable loop
// Each output's float32 sum, term by term: the reference every vector path reproduces.
// fmaf is the fused multiply-add (exactly rounded once), as the vector paths' FMAs.
void group_portable(int64_t kind, const uint8_t* group, int64_t K, const Act* rows, int64_t R, float* out) {
  const int64_t supers = K / super_values(kind), rec = record_bytes(kind);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const Act& a = rows[r];
      float acc = 0.0f;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* rc = group + s * rec;
        if (kind == kQ8_0 || kind == kQ5_0) {
          const float dw = half_at(rc + 2 * lane), da = a.d[s];
          const int8_t* x = a.q + s * 32;
          int32_t isum = 0;
          for (int64_t e = 0; e < 32; ++e) {
            int32_t w;
            if (kind == kQ8_0) {
              w = static_cast<int8_t>(rc[32 + (e / 4) * 64 + lane * 4 + e % 4]);
            } else {
              const uint8_t byte = rc[96 + nibble_at(e / 8, lane, e % 4)];
              const int32_t low = (e % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
              const int32_t bit = (rc[32 + lane * 4 + e % 4] >> (e / 4)) & 1;
              w = (low | (bit << 4)) - 16;
            }
            isum += w * x[e];
          }
          acc = std::fmaf(dw * da, static_cast<float>(isum), acc);
        } else if (kind == kQ4_K) {
          const float d = half_at(rc + 2 * lane), dmin = half_at(rc + 32 + 2 * lane);
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t b = s * 8 + j;
            const float da = a.d[b];
            const float scale = d * static_cast<float>(rc[64 + j * 16 + lane]);
            const float minimum = dmin * static_cast<float>(rc[192 + j * 16 + lane]);
            const uint8_t* nib = rc + 320 + j * 256;
            int32_t isum = 0;
            for (int64_t e = 0; e < 32; ++e) {
              const uint8_t byte = nib[nibble_at(e / 8, lane, e % 4)];
              isum += ((e % 8) < 4 ? (byte & 0x0F) : (byte >> 4)) * a.q[b * 32 + e];
            }
            acc = std::fmaf(scale * da, static_cast<float>(isum), acc);
            acc = std::fmaf(-(minimum * da), static_cast<float>(a.sums[2 * b] + a.sums[2 * b + 1]), acc);
          }
        } else {  // Q6_K
          const float d = half_at(rc + 2 * lane);
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t b = s * 8 + j;
            const uint8_t* blk = rc + 288 + j * 384;
            int32_t half_sums[2] = {0, 0};
            for (int64_t e = 0; e < 32; ++e) {
              const uint8_t byte = blk[nibble_at(e / 8, lane, e % 4)];
              const int32_t low = (e % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
              const int64_t g = e / 4;
              const int32_t high = (blk[256 + (g / 4) * 64 + lane * 4 + e % 4] >> (2 * (g % 4))) & 3;
              half_sums[e / 16] += (low | (high << 4)) * a.q[b * 32 + e];
            }
            const int32_t sc0 = static_cast<int8_t>(rc[32 + (2 * j) * 16 + lane]);
            const int32_t sc1 = static_cast<int8_t>(rc[32 + (2 * j + 1) * 16 + lane]);
            const int32_t isum = sc0 * (half_sums[0] - 32 * a.sums[2 * b]) + sc1 * (half_sums[1] - 32 * a.sums[2 * b + 1]);
            acc = std::fmaf(d * a.d[b], static_cast<float>(isum), acc);
          }
        }
      }
      out[r * kLanes + lane] = acc;
    }
}

// ---------------------------------------------------------------- AVX-512 VNNI
#define LONGSPEC_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

LONGSPEC_AVX512_VNNI inline __m512i nibbles_low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
LONGSPEC_AVX512_VNNI inline __m512i nibbles_high(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
LONGSPEC_AVX512_VNNI inline __m512i run_of(const int8_t* q, int64_t run) {
  int32_t bits;
  std::memcpy(&bits, q + 4 * run, 4);
  return _mm512_set1_epi32(bits);
}
LONGSPEC_AVX512_VNNI inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LONGSPEC_AVX512_VNNI inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
LONGSPEC_AVX512_VNNI inline __m512 bytes_as_float(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// The 8 runs of u8 codes (4 values each, 16 lanes) of a 32-value block, for each format.
// Q8_0's signed codes become w + 128 (the sign bit flipped); the caller subtracts 128 x sum.
LONGSPEC_AVX512_VNNI inline void codes_q8(const uint8_t* rc, __m512i* c) {
  for (int g = 0; g < 8; ++g) c[g] = _mm512_xor_si512(load64(rc + 32 + g * 64), _mm512_set1_epi8(char(0x80)));
}
LONGSPEC_AVX512_VNNI inline void codes_nibbles(const uint8_t* nib, __m512i* c) {
  for (int v = 0; v < 4; ++v) {
    const __m512i w = load64(nib + v * 64);
    c[2 * v] = nibbles_low(w);
    c[2 * v + 1] = nibbles_high(w);
  }
}
LONGSPEC_AVX512_VNNI inline void codes_q5(const uint8_t* rc, __m512i* c) {
  codes_nibbles(rc + 96, c);
  const __m512i bits = load64(rc + 32);
  for (int g = 0; g < 8; ++g)
    // The fifth bit added where set (a low nibble is below 16, so adding is or-ing): two operations a run.
    c[g] = _mm512_mask_add_epi8(c[g], _mm512_test_epi8_mask(bits, _mm512_set1_epi8(char(1 << g))), c[g],
                                _mm512_set1_epi8(0x10));
}
LONGSPEC_AVX512_VNNI inline void codes_q6(const uint8_t* blk, __m512i* c) {
  codes_nibbles(blk, c);
  for (int g = 0; g < 8; ++g) {
    const __m512i pairs = load64(blk + 256 + (g / 4) * 64);
    const __m512i high = _mm512_and_si512(_mm512_srl_epi16(pairs, _mm_cvtsi32_si128(2 * (g % 4))), _mm512_set1_epi8(3));
    c[g] = _mm512_or_si512(c[g], _mm512_slli_epi16(high, 4));
  }
}

// Lane sums of codes x the row's values, runs [from, to): exact int32.
LONGSPEC_AVX512_VNNI inline __m512i dot_runs(const __m512i* c, const int8_t* q, int from, int to) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int g = from; g < to; g += 2) {
    s0 = _mm512_dpbusd_epi32(s0, c[g], run_of(q, g));
    s1 = _mm512_dpbusd_epi32(s1, c[g + 1], run_of(q, g + 1));
  }
  return _mm512_add_epi32(s0, s1);
}

// One 32-value block of one group: its codes (8 runs) and the per-lane factors of its term:
// Q8_0/Q5_0 f0 = d; Q4_K f0 = d x scale, f1 = dmin x minimum; Q6_K f0 = d, s0/s1 the sub-scales.
struct Block512 {
  __m512i c[8];
  __m512 f0, f1;
  __m512i s0, s1;
};

template <int64_t kKind>
constexpr int64_t kBlocksPerRecord = kKind == kQ4_K || kKind == kQ6_K ? 8 : 1;

template <int64_t kKind>
LONGSPEC_AVX512_VNNI inline void unpack_block(const uint8_t* rc, int j, Block512& w) {
  if constexpr (kKind == kQ8_0) {
    w.f0 = halves(rc);
    codes_q8(rc, w.c);
  } else if constexpr (kKind == kQ5_0) {
    w.f0 = halves(rc);
    codes_q5(rc, w.c);
  } else if constexpr (kKind == kQ4_K) {
    w.f0 = _mm512_mul_ps(halves(rc), bytes_as_float(rc + 64 + j * 16, false));
    w.f1 = _mm512_mul_ps(halves(rc + 32), bytes_as_float(rc + 192 + j * 16, false));
    codes_nibbles(rc + 320 + j * 256, w.c);
  } else {
    w.f0 = halves(rc);
    w.s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rc + 32 + (2 * j) * 16)));
    w.s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rc + 32 + (2 * j + 1) * 16)));
    codes_q6(rc + 288 + j * 384, w.c);
  }
}

// Block b's term of one row added to each of G groups' accumulators (`group_portable`'s
// term, lane for lane); the row's scale and code sums are read once for the G groups.
template <int64_t kKind, int G>
LONGSPEC_AVX512_VNNI inline void add_terms(const Block512* w, const Act& a, int64_t b, __m512* acc) {
  const int8_t* q = a.q + b * 32;
  const __m512 da = _mm512_set1_ps(a.d[b]);
  if constexpr (kKind == kQ8_0 || kKind == kQ5_0) {
    const __m512i offset = _mm512_set1_epi32((kKind == kQ8_0 ? 128 : 16) * (a.sums[2 * b] + a.sums[2 * b + 1]));
    for (int g = 0; g < G; ++g)
      acc[g] = _mm512_fmadd_ps(_mm512_mul_ps(w[g].f0, da), _mm512_cvtepi32_ps(_mm512_sub_epi32(dot_runs(w[g].c, q, 0, 8), offset)),
                               acc[g]);
  } else if constexpr (kKind == kQ4_K) {
    const __m512 total = _mm512_set1_ps(static_cast<float>(a.sums[2 * b] + a.sums[2 * b + 1]));
    for (int g = 0; g < G; ++g) {
      acc[g] = _mm512_fmadd_ps(_mm512_mul_ps(w[g].f0, da), _mm512_cvtepi32_ps(dot_runs(w[g].c, q, 0, 8)), acc[g]);
      acc[g] = _mm512_fnmadd_ps(_mm512_mul_ps(w[g].f1, da), total, acc[g]);
    }
  } else {
    const __m512i low = _mm512_set1_epi32(32 * a.sums[2 * b]), high = _mm512_set1_epi32(32 * a.sums[2 * b + 1]);
    for (int g = 0; g < G; ++g) {
      const __m512i h0 = _mm512_sub_epi32(dot_runs(w[g].c, q, 0, 4), low);
      const __m512i h1 = _mm512_sub_epi32(dot_runs(w[g].c, q, 4, 8), high);
      const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(w[g].s0, h0), _mm512_mullo_epi32(w[g].s1, h1));
      acc[g] = _mm512_fmadd_ps(_mm512_mul_ps(w[g].f0, da), _mm512_cvtepi32_ps(isum), acc[g]);
    }
  }
}

// R rows (at most 4) against G groups (two share each row's broadcasts): accumulators stay in
// registers over all blocks. out [R][G][16].
template <int64_t kKind, int R, int G>
LONGSPEC_AVX512_VNNI void few_rows_avx512(const uint8_t* const* groups, int64_t K, const Act* rows, float* out) {
  constexpr int64_t per = kBlocksPerRecord<kKind>;
  const int64_t records = K / (32 * per), rec = record_bytes(kKind);
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  Block512 w[G];
  for (int64_t s = 0; s < records; ++s)
    for (int j = 0; j < per; ++j) {
      for (int g = 0; g < G; ++g) unpack_block<kKind>(groups[g] + s * rec, j, w[g]);
      for (int r = 0; r < R; ++r) add_terms<kKind, G>(w, rows[r], s * per + j, acc[r]);
    }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + (r * G + g) * kLanes, acc[r][g]);
}

// M rows against G groups: each block's codes are unpacked once for all M rows, whose
// accumulators live in out [M][G][16] (the same chain per output, so the same bits).
template <int64_t kKind, int G>
LONGSPEC_AVX512_VNNI void many_rows_avx512(const uint8_t* const* groups, int64_t K, const Act* rows, int64_t M, float* out) {
  constexpr int64_t per = kBlocksPerRecord<kKind>;
  const int64_t records = K / (32 * per), rec = record_bytes(kKind);
  for (int64_t i = 0; i < M * G * kLanes; i += kLanes) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
  Block512 w[G];
  for (int64_t s = 0; s < records; ++s)
    for (int j = 0; j < per; ++j) {
      for (int g = 0; g < G; ++g) unpack_block<kKind>(groups[g] + s * rec, j, w[g]);
      for (int64_t r = 0; r < M; ++r) {
        __m512 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_loadu_ps(out + (r * G + g) * kLanes);
        add_terms<kKind, G>(w, rows[r], s * per + j, acc);
        for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + (r * G + g) * kLanes, acc[g]);
      }
    }
}

// A weight streamed from memory (the output layer), up to this many rows (a tree): a unit is
// one group and its rows run 4 at a time, registers holding the accumulators, the group's
// codes (a few KiB) read again from L1 for each 4 rows; more rows (prefill pieces), and the
// weights that stay in cache, take `many_rows_avx512`. The same chains either way.
constexpr int64_t kTiledRows = 16;
constexpr int64_t kStreamedBytes = int64_t(16) << 20;

template <int64_t kKind, int G>
LONGSPEC_AVX512_VNNI void rows_avx512_of(const uint8_t* const* groups, int64_t K, const Act* rows, int64_t M, float* out,
                                         bool tiled) {
  switch (M) {
    case 1: few_rows_avx512<kKind, 1, G>(groups, K, rows, out); break;
    case 2: few_rows_avx512<kKind, 2, G>(groups, K, rows, out); break;
    case 3: few_rows_avx512<kKind, 3, G>(groups, K, rows, out); break;
    case 4: few_rows_avx512<kKind, 4, G>(groups, K, rows, out); break;
    default:
      if (tiled) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) few_rows_avx512<kKind, 4, G>(groups, K, rows + m, out + m * G * kLanes);
        switch (M - m) {
          case 1: few_rows_avx512<kKind, 1, G>(groups, K, rows + m, out + m * G * kLanes); break;
          case 2: few_rows_avx512<kKind, 2, G>(groups, K, rows + m, out + m * G * kLanes); break;
          case 3: few_rows_avx512<kKind, 3, G>(groups, K, rows + m, out + m * G * kLanes); break;
        }
      } else {
        many_rows_avx512<kKind, G>(groups, K, rows, M, out);
      }
      break;
  }
}

// M rows (any number) against G (1 or 2) groups of one format; out [M][G][16].
void rows_avx512(int64_t kind, const uint8_t* const* groups, int G, int64_t K, const Act* rows, int64_t M, float* out,
                 bool tiled) {
  const bool two = G == 2;
  switch (kind) {
    case kQ8_0: two ? rows_avx512_of<kQ8_0, 2>(groups, K, rows, M, out, tiled) : rows_avx512_of<kQ8_0, 1>(groups, K, rows, M, out, tiled); break;
    case kQ5_0: two ? rows_avx512_of<kQ5_0, 2>(groups, K, rows, M, out, tiled) : rows_avx512_of<kQ5_0, 1>(groups, K, rows, M, out, tiled); break;
    case kQ4_K: two ? rows_avx512_of<kQ4_K, 2>(groups, K, rows, M, out, tiled) : rows_avx512_of<kQ4_K, 1>(groups, K, rows, M, out, tiled); break;
    default: two ? rows_avx512_of<kQ6_K, 2>(groups, K, rows, M, out, tiled) : rows_avx512_of<kQ6_K, 1>(groups, K, rows, M, out, tiled); break;
  }
}

// ---------------------------------------------------------------- AVX2 (8 lanes: a group's two halves)
#define LONGSPEC_AVX2 __attribute__((target("avx2,fma,f16c")))

LONGSPEC_AVX2 inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
LONGSPEC_AVX2 inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
LONGSPEC_AVX2 inline __m256 bytes8_as_float(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}
LONGSPEC_AVX2 inline __m256i run8(const int8_t* q, int64_t run) {
  int32_t bits;
  std::memcpy(&bits, q + 4 * run, 4);
  return _mm256_set1_epi32(bits);
}
// u8 codes (at most 63) x s8 values: pairs of products fit int16 (63 x 127 x 2 < 32767).
LONGSPEC_AVX2 inline __m256i dot4(__m256i codes, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}
LONGSPEC_AVX2 inline void nibbles8(const uint8_t* nib, int h, __m256i* c) {
  for (int v = 0; v < 4; ++v) {
    const __m256i w = load32(nib + v * 64 + 32 * h);
    c[2 * v] = _mm256_and_si256(w, _mm256_set1_epi8(0x0F));
    c[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F));
  }
}
LONGSPEC_AVX2 inline __m256i dot_runs8(const __m256i* c, const int8_t* q, int from, int to) {
  __m256i s = _mm256_setzero_si256();
  for (int g = from; g < to; ++g) s = _mm256_add_epi32(s, dot4(c[g], run8(q, g)));
  return s;
}

template <int R>
LONGSPEC_AVX2 void half_avx2(int64_t kind, const uint8_t* group, int64_t K, const Act* rows, int h, float* out) {
  const int64_t supers = K / super_values(kind), rec = record_bytes(kind);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256i c[8];
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rc = group + s * rec;
    if (kind == kQ8_0) {
      // Signed codes: |w| (u8) x (x with w's sign), pairs at most 2 x 127 x 127.
      const __m256 dw = halves8(rc + 16 * h);
      for (int g = 0; g < 8; ++g) c[g] = load32(rc + 32 + g * 64 + 32 * h);
      for (int r = 0; r < R; ++r) {
        const Act& a = rows[r];
        const int8_t* q = a.q + s * 32;
        __m256i isum = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g)
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c[g], c[g]), _mm256_sign_epi8(run8(q, g), c[g])), _mm256_set1_epi16(1)));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a.d[s])), _mm256_cvtepi32_ps(isum), acc[r]);
      }
    } else if (kind == kQ5_0) {
      const __m256 dw = halves8(rc + 16 * h);
      nibbles8(rc + 96, h, c);
      const __m256i bits = load32(rc + 32 + 32 * h);
      for (int g = 0; g < 8; ++g) {
        const __m256i bit = _mm256_set1_epi8(char(1 << g));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, bit), bit);
        c[g] = _mm256_or_si256(c[g], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
      }
      for (int r = 0; r < R; ++r) {
        const Act& a = rows[r];
        const int32_t total = a.sums[2 * s] + a.sums[2 * s + 1];
        const __m256i isum = _mm256_sub_epi32(dot_runs8(c, a.q + s * 32, 0, 8), _mm256_set1_epi32(16 * total));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a.d[s])), _mm256_cvtepi32_ps(isum), acc[r]);
      }
    } else if (kind == kQ4_K) {
      const __m256 d = halves8(rc + 16 * h), dmin = halves8(rc + 32 + 16 * h);
      for (int j = 0; j < 8; ++j) {
        const int64_t b = s * 8 + j;
        const __m256 scale = _mm256_mul_ps(d, bytes8_as_float(rc + 64 + j * 16 + 8 * h, false));
        const __m256 minimum = _mm256_mul_ps(dmin, bytes8_as_float(rc + 192 + j * 16 + 8 * h, false));
        nibbles8(rc + 320 + j * 256, h, c);
        for (int r = 0; r < R; ++r) {
          const Act& a = rows[r];
          const __m256 da = _mm256_set1_ps(a.d[b]);
          const __m256i isum = dot_runs8(c, a.q + b * 32, 0, 8);
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, da), _mm256_cvtepi32_ps(isum), acc[r]);
          const float total = static_cast<float>(a.sums[2 * b] + a.sums[2 * b + 1]);
          acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(minimum, da), _mm256_set1_ps(total), acc[r]);
        }
      }
    } else {  // Q6_K
      const __m256 d = halves8(rc + 16 * h);
      for (int j = 0; j < 8; ++j) {
        const int64_t b = s * 8 + j;
        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rc + 32 + (2 * j) * 16 + 8 * h)));
        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rc + 32 + (2 * j + 1) * 16 + 8 * h)));
        const uint8_t* blk = rc + 288 + j * 384;
        nibbles8(blk, h, c);
        for (int g = 0; g < 8; ++g) {
          const __m256i pairs = load32(blk + 256 + (g / 4) * 64 + 32 * h);
          const __m256i high = _mm256_and_si256(_mm256_srl_epi16(pairs, _mm_cvtsi32_si128(2 * (g % 4))), _mm256_set1_epi8(3));
          c[g] = _mm256_or_si256(c[g], _mm256_slli_epi16(high, 4));
        }
        for (int r = 0; r < R; ++r) {
          const Act& a = rows[r];
          const int8_t* q = a.q + b * 32;
          const __m256i h0 = _mm256_sub_epi32(dot_runs8(c, q, 0, 4), _mm256_set1_epi32(32 * a.sums[2 * b]));
          const __m256i h1 = _mm256_sub_epi32(dot_runs8(c, q, 4, 8), _mm256_set1_epi32(32 * a.sums[2 * b + 1]));
          const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(sc0, h0), _mm256_mullo_epi32(sc1, h1));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.d[b])), _mm256_cvtepi32_ps(isum), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kLanes + 8 * h, acc[r]);
}

template <int R>
LONGSPEC_AVX2 void group_avx2(int64_t kind, const uint8_t* group, int64_t K, const Act* rows, float* out) {
  half_avx2<R>(kind, group, K, rows, 0, out);
  half_avx2<R>(kind, group, K, rows, 1, out);
}

// ---------------------------------------------------------------- vector row quantizers
// `quantize_row`'s operations on 16 (8) values at once: the block's amax is a maximum (exact
// in any order; a NaN is skipped as fmax skips it), the scale and its reciprocal the same
// scalar operations, each product rounded once, round-half-even, the sums exact integers.
LONGSPEC_AVX512_VNNI inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
LONGSPEC_AVX512_VNNI inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
LONGSPEC_AVX512_VNNI void quantize_row_avx512(const T* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m);
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    d[b] = scale;
    const __m512 inv = _mm512_set1_ps(inverse), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    const __m512 v[2] = {v0, v1};
    for (int h = 0; h < 2; ++h) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i codes = _mm512_cvtps_epi32(_mm512_max_ps(bottom, _mm512_min_ps(top, r)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(codes));
      sums[2 * b + h] = _mm512_reduce_add_epi32(codes);
    }
  }
}

LONGSPEC_AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
LONGSPEC_AVX2 inline __m256 load8(const c10::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
LONGSPEC_AVX2 inline int32_t add_lanes8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <typename T>
LONGSPEC_AVX2 void quantize_row_avx2(const T* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kBlock + 8 * i);
      m = _mm256_max_ps(_mm256_and_ps(v[i], sign), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_shuffle_ps(h, h, 0x4E));
    h = _mm_max_ps(h, _mm_shuffle_ps(h, h, 0xB1));
    const float amax = _mm_cvtss_f32(h);
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    d[b] = scale;
    const __m256 inv = _mm256_set1_ps(inverse), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    __m256i codes[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      codes[i] = _mm256_cvtps_epi32(_mm256_max_ps(bottom, _mm256_min_ps(top, r)));
    }
    // Packing interleaves 128-bit halves; the permutation puts the 32 codes back in order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    sums[2 * b] = add_lanes8(_mm256_add_epi32(codes[0], codes[1]));
    sums[2 * b + 1] = add_lanes8(_mm256_add_epi32(codes[2], codes[3]));
  }
}

template <typename T>
void quantize_row_on(Path path, const T* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  if (path == Path::kAvx512Vnni) quantize_row_avx512(x, K, q, d, sums);
  else if (path == Path::kAvx2) quantize_row_avx2(x, K, q, d, sums);
  else quantize_row(x, K, q, d, sums);
}

Acts quantize(const at::Tensor& x, Path path) {
  const int64_t M = x.size(0), K = x.size(1);
  Acts a;
  a.K = K;
  a.blocks = K / kBlock;
  a.q.resize(M * K);
  a.d.resize(M * a.blocks);
  a.sums.resize(M * 2 * a.blocks);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* data = x.data_ptr();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = a.q.data() + m * K;
      float* d = a.d.data() + m * a.blocks;
      int32_t* s = a.sums.data() + m * 2 * a.blocks;
      if (bf16) quantize_row_on(path, static_cast<const c10::BFloat16*>(data) + m * K, K, q, d, s);
      else quantize_row_on(path, static_cast<const float*>(data) + m * K, K, q, d, s);
    }
  });
  return a;
}

// ---------------------------------------------------------------- dispatch

bool avx512_vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

bool avx2_supported() { return avx2_fma_supported() && __builtin_cpu_supports("f16c"); }

// One path per process, as the other kernels (every path gives the same bits here, but
// a single choice keeps that a property to test rather than to rely on).
Path best_path() {
  static const Path best = avx512_vnni_supported() ? Path::kAvx512Vnni : avx2_supported() ? Path::kAvx2 : Path::kPortable;
  return best;
}

Path path_named(const std::string& name) {
  if (name == "native") return best_path();
  if (name == "portable") return Path::kPortable;
  if (name == "avx2") {
    TORCH_CHECK(avx2_supported(), "the AVX2 path needs AVX2, FMA and F16C");
    return Path::kAvx2;
  }
  if (name == "avx512_vnni") {
    TORCH_CHECK(avx512_vnni_supported(), "the AVX-512 VNNI path needs AVX-512 F/BW/VL and VNNI");
    return Path::kAvx512Vnni;
  }
  TORCH_CHECK(false, "unknown path ", name, ": native, portable, avx2 or avx512_vnni");
}

std::string path_name(Path p) {
  return p == Path::kAvx512Vnni ? "avx512_vnni" : p == Path::kAvx2 ? "avx2" : "portable";
}

template <int R>
void run_group(Path path, int64_t kind, const uint8_t* group, int64_t K, const Act* rows, float* out) {
  if (path == Path::kAvx2) group_avx2<R>(kind, group, K, rows, out);
  else group_portable(kind, group, K, rows, R, out);
}

// Rows of x past which a unit's products start again (its accumulators, M x 2 x 16 floats, in L1).
constexpr int64_t kRowChunk = 64;

// M rows against G groups of one format: out [M][G][16]. AVX-512 VNNI runs the G groups in one
// pass over the blocks; the other paths a group and up to kRowTile rows at a time.
void run_unit(Path path, int64_t kind, const uint8_t* const* groups, int G, int64_t K, const Act* rows, int64_t M,
              float* out, bool tiled) {
  if (path == Path::kAvx512Vnni) return rows_avx512(kind, groups, G, K, rows, M, out, tiled);
  float tile_out[kRowTile * kLanes];
  for (int g = 0; g < G; ++g)
    for (int64_t m = 0; m < M; m += kRowTile) {
      const int64_t R = std::min<int64_t>(kRowTile, M - m);
      switch (R) {
        case 4: run_group<4>(path, kind, groups[g], K, rows + m, tile_out); break;
        case 3: run_group<3>(path, kind, groups[g], K, rows + m, tile_out); break;
        case 2: run_group<2>(path, kind, groups[g], K, rows + m, tile_out); break;
        default: run_group<1>(path, kind, groups[g], K, rows + m, tile_out); break;
      }
      for (int64_t r = 0; r < R; ++r)
        std::memcpy(out + ((m + r) * G + g) * kLanes, tile_out + r * kLanes, kLanes * sizeof(float));
    }
}

// A unit of work: up to two neighbouring groups of one segment.
struct Unit {
  int64_t segment, group, count;
};

// One weight = segments of rows (a fused q/k/v may mix formats), outputs side by side.
at::Tensor linear_on(Path path, const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& kinds,
                     const std::vector<int64_t>& rows, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: contiguous [M, K] bf16 or float32");
  TORCH_CHECK(packed.size() == kinds.size() && kinds.size() == rows.size() && !packed.empty(), "one kind and row count per segment");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "x has ", K, " columns, not a multiple of 32");
  // Groups a unit: for a weight streamed from memory (kStreamedBytes or more: the output layer)
  // and up to kTiledRows rows (a decode step, a tree), one, so that a thread reads the weight as
  // one sequence of addresses: two neighbouring groups read side by side are two streams, which
  // the hardware prefetchers of a Zen 4 core serve at two thirds of one stream's rate
  // (docs/lab-notes/quantized-targets.md). Else two, sharing each row's broadcasts.
  int64_t weight_bytes = 0;
  for (const at::Tensor& p : packed) weight_bytes += p.numel();
  const bool tiled = weight_bytes >= kStreamedBytes && M <= kTiledRows;
  const int64_t width = tiled ? 1 : 2;
  int64_t N = 0;
  std::vector<int64_t> first_row(packed.size(), 0);
  std::vector<Unit> units;
  for (size_t i = 0; i < packed.size(); ++i) {
    const int64_t sv = super_values(kinds[i]), groups = (rows[i] + kLanes - 1) / kLanes;
    TORCH_CHECK(K % sv == 0, "GGML type ", kinds[i], " needs rows of a multiple of ", sv, " values, x has ", K);
    TORCH_CHECK(packed[i].scalar_type() == at::kByte && packed[i].is_contiguous() && packed[i].dim() == 2 &&
                    packed[i].size(0) == groups && packed[i].size(1) == K / sv * record_bytes(kinds[i]),
                "segment ", i, " is not a repacked [", groups, ", ", K / sv * record_bytes(kinds[i]), "] weight");
    first_row[i] = N;
    N += rows[i];
    for (int64_t g = 0; g < groups; g += width) units.push_back({static_cast<int64_t>(i), g, std::min<int64_t>(width, groups - g)});
  }
  std::vector<float> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bias of ", N, " values");
    const at::Tensor b = bias->to(at::kFloat);
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Acts acts = quantize(x, path);
  std::vector<Act> act_rows(M);
  for (int64_t m = 0; m < M; ++m) act_rows[m] = acts.row(m);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  void* ys = y.data_ptr();
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(std::min(M, kRowChunk) * 2 * kLanes);
    for (int64_t u = begin; u < end; ++u) {
      const Unit unit = units[u];
      const at::Tensor& weight = packed[unit.segment];
      const uint8_t* groups[2] = {weight.data_ptr<uint8_t>() + unit.group * weight.size(1),
                                  weight.data_ptr<uint8_t>() + (unit.group + 1) * weight.size(1)};
      const int G = static_cast<int>(unit.count);
      for (int64_t m = 0; m < M; m += kRowChunk) {
        const int64_t R = std::min(kRowChunk, M - m);
        run_unit(path, kinds[unit.segment], groups, G, K, act_rows.data() + m, R, out.data(), tiled);
        for (int g = 0; g < G; ++g) {
          const int64_t n0 = first_row[unit.segment] + (unit.group + g) * kLanes;
          const int64_t lanes = std::min<int64_t>(kLanes, first_row[unit.segment] + rows[unit.segment] - n0);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < lanes; ++i) {
              const float v = out[(r * G + g) * kLanes + i];
              const float with_bias = bias_f.empty() ? v : v + bias_f[n0 + i];
              const int64_t at = (m + r) * N + n0 + i;
              if (bf16) static_cast<c10::BFloat16*>(ys)[at] = c10::BFloat16(with_bias);
              else static_cast<float*>(ys)[at] = with_bias;
            }
        }
      }
    }
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, std::vector<at::Tensor> packed, std::vector<int64_t> kinds, std::vector<int64_t> rows,
                  const std::optional<at::Tensor>& bias) {
  return linear_on(best_path(), x, packed, kinds, rows, bias);
}

at::Tensor linear_path(const at::Tensor& x, std::vector<at::Tensor> packed, std::vector<int64_t> kinds,
                       std::vector<int64_t> rows, const std::optional<at::Tensor>& bias, std::string path) {
  return linear_on(path_named(path), x, packed, kinds, rows, bias);
}

// The row quantization the products use, for tests: (codes [M, K] int8, scales [M, K/32] float32).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, std::string path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.size(1) % kBlock == 0,
              "x: contiguous [M, K] bf16 or float32, K a multiple of 32");
  const Acts a = quantize(x, path_named(path));
  at::Tensor q = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({x.size(0), a.blocks}, x.options().dtype(at::kFloat));
  if (!a.q.empty()) std::memcpy(q.data_ptr(), a.q.data(), a.q.size());
  if (!a.d.empty()) std::memcpy(d.data_ptr(), a.d.data(), a.d.size() * sizeof(float));
  return {q, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("gguf_repack(Tensor raw, int kind, int k) -> Tensor");
  m.impl("gguf_repack", c10::DispatchKey::CPU, TORCH_FN(repack));
  m.def("gguf_linear(Tensor x, Tensor[] packed, int[] kinds, int[] rows, Tensor? bias) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("gguf_linear_on(Tensor x, Tensor[] packed, int[] kinds, int[] rows, Tensor? bias, str path) -> Tensor");
  m.impl("gguf_linear_on", c10::DispatchKey::CPU, TORCH_FN(linear_path));
  m.def("gguf_quantize_rows(Tensor x, str path=\"native\") -> (Tensor, Tensor)");
  m.impl("gguf_quantize_rows", c10::DispatchKey::CPU, TORCH_FN(quantize_rows));
  m.def("gguf_linear_path() -> str", []() { return path_name(best_path()); });
  m.def("gguf_linear_paths() -> str[]", []() {
    std::vector<std::string> paths{"portable"};
    if (avx2_supported()) paths.push_back("avx2");
    if (avx512_vnni_supported()) paths.push_back("avx512_vnni");
    return paths;
  });
}
