// Q8_0 weights over many activation rows with AVX512-VNNI (qmatmul.cpp, weight type 1): prefill and decode steps of
// several rows. The narrow tile of qmatmul.cpp (`group_q8`: one group of 8 output rows x at most 4 activation rows in
// 256-bit vectors) keeps 4 dependent chains of `vpdpbusd` in flight, half of what the core can issue. This tile
// puts two groups side by side in one 512-bit vector (16 outputs) and takes up to kQ8Tile activation rows: each
// weight vector is loaded once for all of them, and each row is its own chain.
//
// The activations of a tile are interleaved first (`interleave_q8`): word (b * 8 + i) * mt + m holds row m's
// 4 bytes x[32 b + 4 i .. + 3], so every broadcast sits at a constant offset from one pointer (a pointer per row
// runs out of registers). A tile of mt rows starting at row m of the call takes exactly its rows' bytes, so its
// words start at byte m * K of the interleaved buffer, and its scales and offsets at m * nb.
//
// Every output is the same arithmetic as the narrow tile's, lane for lane: per block, the exact integer sum
// sum((q + 128) x) - 128 sum(x), converted, then acc += float(isum) * (d * a) with the same rounding. So a row's
// outputs are the same bits in any tile, batch and thread count.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

#include "qact.h"

#if CS_Q_AVX2 && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CS_Q8_WIDE 1
#else
#define CS_Q8_WIDE 0
#endif

namespace csq {

#if CS_Q8_WIDE
constexpr int64_t kQ8WideBytes = 272;  // one packed Q8_0 block of a group (qmatmul.cpp, "Packed weights")
constexpr int kQ8Tile = 12;  // activation rows per tile at most
constexpr int64_t kQ8WidePrefetch = 8192;  // bytes ahead of the blocks being read, in each of the two groups
// Calls of fewer rows keep the narrow tile: at 4 rows the wide tile is 1.3x faster over a layer's weights (which stay
// in the L3 between steps) but half as fast over the 28 MB lm_head read from memory (two weight streams; Zen 4).
inline bool q8_wide_for(int64_t M, int64_t N, int64_t K) { return M >= 8 || (M >= 4 && N * K <= (int64_t{8} << 20)); }

// Rows of the next tile with `left` rows still to do: the fewest tiles, as even as they go (16 rows: 8 + 8).
constexpr int q8_tile_rows(int64_t left) {
  return static_cast<int>((left + (left + kQ8Tile - 1) / kQ8Tile - 1) / ((left + kQ8Tile - 1) / kQ8Tile));
}

// The tiles of rows [m0, m1) in order: fn(m, mt).
template <class F>
void for_q8_tiles(int64_t m0, int64_t m1, F fn) {
  for (int64_t m = m0; m < m1;) {
    const int mt = q8_tile_rows(m1 - m);
    fn(m, mt);
    m += mt;
  }
}

// Rows [m, m + mt) of the quantised activations (xq: row stride K; xa, xsum: [rows, nb]) -> the tile's words
// xw (at byte m * K), scales xat and integer offsets -128 * sum(x) xot (both at m * nb), block by block.
inline void interleave_q8(const int8_t* xq, const float* xa, const float* xsum, int64_t K, int64_t m, int mt,
                          int32_t* xw, float* xat, int32_t* xot) {
  const int64_t nb = K / kBlock;
  int32_t* w = xw + m * K / 4;
  for (int r = 0; r < mt; ++r)
    for (int64_t p = 0; p < K / 4; ++p) std::memcpy(w + p * mt + r, xq + (m + r) * K + 4 * p, 4);
  for (int r = 0; r < mt; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      xat[m * nb + b * mt + r] = xa[(m + r) * nb + b];
      xot[m * nb + b * mt + r] = -128 * static_cast<int32_t>(xsum[(m + r) * nb + b]);
    }
}

// All M rows, tile by tile in pieces of `piece` rows (the row pieces the tiles are called with).
inline void interleave_q8_rows(const int8_t* xq, const float* xa, const float* xsum, int64_t M, int64_t K,
                               int64_t piece, int32_t* xw, float* xat, int32_t* xot) {
  for (int64_t m0 = 0; m0 < M; m0 += piece)
    for_q8_tiles(m0, m0 + piece < M ? m0 + piece : M,
                 [&](int64_t m, int mt) { interleave_q8(xq, xa, xsum, K, m, mt, xw, xat, xot); });
}

// Groups pa and pb (nb blocks each) x MT interleaved rows; out[m * 16 + r]: r < 8 from pa, r >= 8 from pb.
template <int MT>
void group_q8_wide(const uint8_t* pa, const uint8_t* pb, int64_t nb, const int32_t* xw, const float* xa,
                   const int32_t* xo, float* out) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pa += kQ8WideBytes, pb += kQ8WideBytes, xw += 8 * MT, xa += MT, xo += MT) {
    for (int64_t c = 0; c < kQ8WideBytes; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(pa) + kQ8WidePrefetch + c, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pb) + kQ8WidePrefetch + c, _MM_HINT_T0);
    }
    __m512i p[MT];
    for (int m = 0; m < MT; ++m) p[m] = _mm512_set1_epi32(xo[m]);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa + 32 * i))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32 * i)), 1);
#pragma GCC unroll 12
      for (int m = 0; m < MT; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w, _mm512_set1_epi32(xw[i * MT + m]));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pa + 256))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 256)), 1));
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[m]), _mm512_mul_ps(d, _mm512_set1_ps(xa[m])), acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}

// 16 consecutive outputs v of one row -> y (fp32, or bf16 rounded to nearest even with NaN kept), plus bias[16]
// (ydtype) when given, added to y when accumulating: store_tile's arithmetic, 16 lanes at a time.
inline __m512i q8_to_bf16_bits(__m512 x) {  // as f_to_bf16, in the low 16 bits of each lane
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
inline __m512 q8_bf16_load(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}
inline void store16(const float* v, const void* bias, int ydtype, bool accumulate, void* y) {
  __m512 x = _mm512_loadu_ps(v);
  if (ydtype == 0) {
    if (bias != nullptr) x = _mm512_add_ps(x, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, accumulate ? _mm512_add_ps(_mm512_loadu_ps(y), x) : x);
    return;
  }
  if (bias != nullptr) x = _mm512_add_ps(x, q8_bf16_load(bias));
  if (accumulate)  // ATen: y + round(v)
    x = _mm512_add_ps(q8_bf16_load(y), _mm512_castsi512_ps(_mm512_slli_epi32(q8_to_bf16_bits(x), 16)));
  _mm256_storeu_si256(static_cast<__m256i*>(y), _mm512_cvtepi32_epi16(q8_to_bf16_bits(x)));
}

template <int... MT>
void q8_wide_rows(std::integer_sequence<int, MT...>, int mt, const uint8_t* pa, const uint8_t* pb, int64_t nb,
                  const int32_t* xw, const float* xa, const int32_t* xo, float* out) {
  ((mt == MT + 1 ? group_q8_wide<MT + 1>(pa, pb, nb, xw, xa, xo, out) : void()), ...);
}

// Groups pa, pb over rows [m0, m1) of the interleaved activations: each tile's outputs go to out[m * 16 + r]
// (m < mt), then store(m, mt) for the tile's first row m.
template <class Store>
void q8_wide_tiles(const uint8_t* pa, const uint8_t* pb, int64_t nb, const int32_t* xw, const float* xat,
                   const int32_t* xot, int64_t m0, int64_t m1, float* out, Store store) {
  for_q8_tiles(m0, m1, [&](int64_t m, int mt) {
    q8_wide_rows(std::make_integer_sequence<int, kQ8Tile>{}, mt, pa, pb, nb, xw + m * nb * 8, xat + m * nb,
                 xot + m * nb, out);
    store(m, mt);
  });
}
#endif

}  // namespace csq
