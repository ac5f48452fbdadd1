// Register tiles of the in-place decode kernel (decode_cpu.cpp): the GB <= 4 query heads of a KV head share
// every key and value they read. Scores: GB rows x KU keys of vector accumulators over the head dim, each
// key converted to fp32 once for all GB rows, one horizontal sum per score. P@V: GB rows x DB vectors of the
// head dim held in registers across the chunk's keys, each value converted once for all GB rows.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace cs_tile {

using cs::kW;
using cs::vf;

constexpr int64_t kRowStride = 256;  // sc / p: row r of the scores at r * kRowStride (decode_cpu.cpp's kMaxC)
constexpr int KU = kW == 16 ? 4 : 2;  // keys per score tile (AVX-512: 16 + 4 + 1 of 32 registers)
constexpr int DB = kW == 16 ? 4 : 2;  // head-dim vectors per P@V tile

template <typename T> inline vf loadv(const T* p);
template <> inline vf loadv<float>(const float* p) { return cs::load(p); }
template <> inline vf loadv<cs::Bf16>(const cs::Bf16* p) {
#if defined(__AVX512F__)  // one vpmovzxwd zmm (GCC splits the generic conversion below into 256-bit halves)
  return (vf)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  typedef uint16_t vh __attribute__((vector_size(kW * 2)));
  vh h;
  std::memcpy(&h, p, sizeof(vh));
  const cs::vi w = __builtin_convertvector(h, cs::vi) << 16;  // bf16 bits are the high half of fp32's
  vf f;
  std::memcpy(&f, &w, sizeof(vf));
  return f;
#endif
}
template <> inline vf loadv<_Float16>(const _Float16* p) {
  typedef _Float16 vh __attribute__((vector_size(kW * 2)));
  vh h;
  std::memcpy(&h, p, sizeof(vh));
  return __builtin_convertvector(h, vf);
}

// The sum of a vector's lanes as a halving tree (log2(kW) shuffles and adds, not kW - 1 extracts).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  typedef float v8 __attribute__((vector_size(32)));
  v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX__) || defined(__ARM_NEON)
  typedef float v8 __attribute__((vector_size(32)));
  v8 h = v;
#else
  float s = 0.f;
  for (int w = 0; w < kW; ++w) s += v[w];
  return s;
#endif
#if defined(__AVX512F__) || defined(__AVX__) || defined(__ARM_NEON)
  typedef float v4 __attribute__((vector_size(16)));
  typedef float v2 __attribute__((vector_size(8)));
  const v4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const v2 e = __builtin_shufflevector(f, f, 0, 1) + __builtin_shufflevector(f, f, 2, 3);
  return e[0] + e[1];
#endif
}

// sc[r * kRowStride + t] = q_r . k_t for the GB rows q [GB, d] and nt keys kc [nt, d]; d % kW == 0.
template <typename T, int GB>
inline void scores(const float* q, const T* kc, int64_t nt, int64_t d, float* sc) {
  int64_t t = 0;
  for (; t + KU <= nt; t += KU) {
    vf s[GB][KU] = {};
    const T* kt = kc + t * d;  // key t + u at kt[u * d]
    for (int64_t j = 0; j < d; j += kW) {
      vf k[KU];
#pragma GCC unroll 4
      for (int u = 0; u < KU; ++u) k[u] = loadv<T>(kt + u * d + j);
#pragma GCC unroll 4
      for (int r = 0; r < GB; ++r) {
        const vf qv = cs::load(q + r * d + j);
#pragma GCC unroll 4
        for (int u = 0; u < KU; ++u) s[r][u] += qv * k[u];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < KU; ++u) sc[r * kRowStride + t + u] = hsum(s[r][u]);
  }
  for (; t < nt; ++t) {
    vf s[GB] = {};
    for (int64_t j = 0; j < d; j += kW) {
      const vf k = loadv<T>(kc + t * d + j);
#pragma GCC unroll 4
      for (int r = 0; r < GB; ++r) s[r] += cs::load(q + r * d + j) * k;
    }
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r) sc[r * kRowStride + t] = hsum(s[r]);
  }
}

// acc[r] [d] += sum_t p[r * kRowStride + t] * v_t for the GB rows and nt values vc [nt, d]; d % kW == 0.
template <typename T, int GB>
inline void pv(const float* p, const T* vc, int64_t nt, int64_t d, float* acc) {
  int64_t j = 0;
  for (; j + DB * kW <= d; j += DB * kW) {
    vf a[GB][DB];
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < DB; ++v) a[r][v] = cs::load(acc + r * d + j + v * kW);
    for (int64_t t = 0; t < nt; ++t) {
      vf vv[DB];
#pragma GCC unroll 4
      for (int v = 0; v < DB; ++v) vv[v] = loadv<T>(vc + t * d + j + v * kW);
#pragma GCC unroll 4
      for (int r = 0; r < GB; ++r) {
        const float pw = p[r * kRowStride + t];
#pragma GCC unroll 4
        for (int v = 0; v < DB; ++v) a[r][v] += pw * vv[v];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < DB; ++v) cs::store(acc + r * d + j + v * kW, a[r][v]);
  }
  for (; j < d; j += kW) {
    vf a[GB];
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r) a[r] = cs::load(acc + r * d + j);
    for (int64_t t = 0; t < nt; ++t) {
      const vf vv = loadv<T>(vc + t * d + j);
#pragma GCC unroll 4
      for (int r = 0; r < GB; ++r) a[r] += p[r * kRowStride + t] * vv;
    }
#pragma GCC unroll 4
    for (int r = 0; r < GB; ++r) cs::store(acc + r * d + j, a[r]);
  }
}

// The g rows of a KV head in groups of up to 4: f(group start, its rows as a compile-time constant).
template <typename F>
inline void by_groups(int64_t g, F&& f) {
  int64_t g0 = 0;
  for (; g0 + 4 <= g; g0 += 4) f(g0, std::integral_constant<int, 4>{});
  switch (g - g0) {
    case 3: f(g0, std::integral_constant<int, 3>{}); break;
    case 2: f(g0, std::integral_constant<int, 2>{}); break;
    case 1: f(g0, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

}  // namespace cs_tile
