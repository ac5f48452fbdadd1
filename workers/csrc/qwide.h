// Q8_0 and Q4_1 weights over many activation rows with AVX512-VNNI (qmatmul.cpp, weight types 1 and 0): prefill and
// decode steps of several rows. The narrow tiles (qnarrow.h: one group of 8 output rows x at most 4 activation rows
// in 256-bit vectors) keep 4 dependent chains of `vpdpbusd` in flight, half of what the core can issue. These tiles
// put two groups side by side in one 512-bit vector (16 outputs) and take up to kQ8Tile (Q8_0) or kQ4Tile (Q4_1)
// activation rows: each weight vector is loaded (and, for Q4_1, unpacked) once for all of them, and each row is its
// own chain. Q8_0 calls of kQuadRows rows or more (prefill) take four groups (two such vectors) x up to kQ8QuadTile
// rows instead (`group_q8_wide<MT, 2>`): each broadcast of a row's bytes then feeds two `vpdpbusd`.
//
// The activations of a tile are interleaved first (`interleave_q`): word (b * 8 + i) * mt + m holds row m's
// 4 bytes x[32 b + 4 i .. + 3], so every broadcast sits at a constant offset from one pointer (a pointer per row
// runs out of registers). A tile of mt rows starting at row m of the call takes exactly its rows' bytes, so its
// words start at byte m * K of the interleaved buffer, and its per-block scales and sums at m * nb.
//
// Every output is the same arithmetic as the narrow tile's, lane for lane: per block the exact integer sums
// (Q8_0: sum((q + 128) x) - 128 sum(x)), converted, then acc += float(isum) * (d * a) (Q4_1: + m * s) with the same
// roundings. So a row's outputs are the same bits in any tile, batch and thread count.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "qact.h"

#if CS_Q_AVX2 && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CS_Q_WIDE 1
#else
#define CS_Q_WIDE 0
#endif

namespace csq {

#if CS_Q_WIDE
constexpr int64_t kQ8WideBytes = 272, kQ4WideBytes = 160;  // a packed block of a group (qmatmul.cpp)
// Activation rows per tile at most: Q8_0 pairs of groups take up to 12 rows, Q4_1 pairs 8 (two chains a row). Calls
// of kQuadRows rows or more (prefill) take Q8_0 four groups at a time (two 512-bit vectors) x up to 6 rows (24
// accumulators): a layer's int8 linears over 512 rows take 15-20 % less time, but they were slower under 48 rows
// (decode: 8-32 rows, weights read from memory).
constexpr int kQ8Tile = 12, kQ4Tile = 8, kQ8QuadTile = 6;
constexpr int64_t kQuadRows = 48;
// Bytes ahead of the blocks being read, in each of the two groups, fetched into the L2 (prefetcht1): a decode call's
// weights come from memory, and its second tile of rows re-reads the first's from the L1 without fetching ahead.
// Int8 layers' matmuls at 8 / 16 / 32 rows on Zen 5, one thread: 4.1-4.3 / 7.4-7.7 / 13.2-13.4 ms a step against
// 5.2-5.4 / 8.4-8.7 / 13.7-14.5 ms 8 KiB ahead into the L1 (which, 2 x 16 KiB ahead, a 32 KiB L1 could not hold).
constexpr int64_t kQWidePrefetch = 16384;
// Calls of fewer rows keep the narrow tile: at 4 rows the wide tile is 1.3x faster over a layer's weights (which stay
// in the L3 between steps) but was half as fast over the 28 MB lm_head read from memory (two weight streams; Zen 4).
// With the L2 prefetch above it reads the lm_head faster from 5 rows on (Zen 5, int8: 0.68-0.95 against 1.31 ms at 5
// rows, 0.73-0.83 against 1.70-1.75 ms at 7); at 4 rows the two are within noise, so the lm_head keeps the narrow tile.
inline bool q_wide_for(int64_t M, int64_t N, int64_t K) { return M >= 5 || (M >= 4 && N * K <= (int64_t{8} << 20)); }
inline bool q_quad_for(int wtype, int64_t M) { return wtype == 1 && M >= kQuadRows; }
// The rows per tile at most of a call (the interleaved layout and the tiles must agree).
inline int q_tile_max(int wtype, int64_t M) { return q_quad_for(wtype, M) ? kQ8QuadTile : wtype == 1 ? kQ8Tile : kQ4Tile; }

// The tiles of rows [m0, m1) in order: fn(m, mt).
template <class F>
void for_q_tiles(int64_t m0, int64_t m1, int most, F fn) {
  for (int64_t m = m0; m < m1;) {
    const int mt = tile_rows(m1 - m, most);
    fn(m, mt);
    m += mt;
  }
}

// Rows [m, m + mt) of the quantised activations (xq: row stride K; xa, xs: [rows, nb]) -> the tile's words xw (at
// byte m * K), scales xat and per-block words xot (at m * nb), block by block: Q8_0 (q8) the integer offsets
// -128 * sum(q) (xs holds the integer sums), Q4_1 the bits of xs = a * sum(q).
inline void interleave_q(const int8_t* xq, const float* xa, const float* xs, int64_t K, int64_t m, int mt, bool q8,
                         int32_t* xw, float* xat, int32_t* xot) {
  const int64_t nb = K / kBlock;
  int32_t* w = xw + m * K / 4;
  for (int r = 0; r < mt; ++r)
    for (int64_t p = 0; p < K / 4; ++p) std::memcpy(w + p * mt + r, xq + (m + r) * K + 4 * p, 4);
  for (int r = 0; r < mt; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float s = xs[(m + r) * nb + b];
      xat[m * nb + b * mt + r] = xa[(m + r) * nb + b];
      if (q8) {
        xot[m * nb + b * mt + r] = -128 * static_cast<int32_t>(s);
      } else {
        std::memcpy(xot + m * nb + b * mt + r, &s, 4);
      }
    }
}

// All M rows, tile by tile in pieces of `piece` rows (the row pieces the tiles are called with).
inline void interleave_q_rows(const int8_t* xq, const float* xa, const float* xs, int64_t M, int64_t K,
                              int64_t piece, int wtype, int32_t* xw, float* xat, int32_t* xot) {
  for (int64_t m0 = 0; m0 < M; m0 += piece)
    for_q_tiles(m0, m0 + piece < M ? m0 + piece : M, q_tile_max(wtype, M),
                [&](int64_t m, int mt) { interleave_q(xq, xa, xs, K, m, mt, wtype == 1, xw, xat, xot); });
}

// Two 256-bit pieces (one from each group) as one 512-bit vector; two fp16 x 8 as 16 floats.
inline __m512i q_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline __m512 q_pair_fp16(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
inline void q_prefetch(const uint8_t* pa, const uint8_t* pb, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(pa) + kQWidePrefetch + c, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(pb) + kQWidePrefetch + c, _MM_HINT_T1);
  }
}

// Q8_0 over NP pairs of groups (pair n: groups p + 2n gb and p + (2n + 1) gb, gb bytes a group, nb blocks each) x MT
// interleaved rows; out[(m * NP + n) * 16 + r]: r < 8 from the pair's first group, r >= 8 from its second. With NP 2
// (`kQ8QuadTile` rows at most) each broadcast of 4 activation bytes feeds two `vpdpbusd`, half the broadcasts of NP 1
// per product: 415 against 356 GMAC/s for a warm tile on Zen 5. Each pair's lanes get the same arithmetic either way.
template <int MT, int NP>
void group_q8_wide(const uint8_t* p, int64_t gb, int64_t nb, const int32_t* xw, const float* xa, const int32_t* xo,
                   float* out) {
  const uint8_t* g[2 * NP];
  for (int n = 0; n < 2 * NP; ++n) g[n] = p + n * gb;
  __m512 acc[NP][MT];
  for (int n = 0; n < NP; ++n)
    for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, xw += 8 * MT, xa += MT, xo += MT) {
    for (int n = 0; n < NP; ++n) q_prefetch(g[2 * n], g[2 * n + 1], kQ8WideBytes);
    __m512i s[NP][MT];
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NP; ++n) s[n][m] = _mm512_set1_epi32(xo[m]);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512i w[NP];
      for (int n = 0; n < NP; ++n) w[n] = q_pair(g[2 * n] + 32 * i, g[2 * n + 1] + 32 * i);
#pragma GCC unroll 12
      for (int m = 0; m < MT; ++m) {
        const __m512i x = _mm512_set1_epi32(xw[i * MT + m]);
        for (int n = 0; n < NP; ++n) s[n][m] = _mm512_dpbusd_epi32(s[n][m], w[n], x);
      }
    }
    for (int n = 0; n < NP; ++n) {
      const __m512 d = q_pair_fp16(g[2 * n] + 256, g[2 * n + 1] + 256);
      for (int m = 0; m < MT; ++m)
        acc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[n][m]), _mm512_mul_ps(d, _mm512_set1_ps(xa[m])), acc[n][m]);
    }
    for (int n = 0; n < 2 * NP; ++n) g[n] += kQ8WideBytes;
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NP; ++n) _mm512_storeu_ps(out + (m * NP + n) * 16, acc[n][m]);
}

// Q4_1 groups: per block the low nibbles (elements 4i..) and the high ones (16 + 4i..) in two chains, as the narrow
// tile; xo holds the bits of a * sum(q) for the minimum term.
template <int MT>
void group_q4_wide(const uint8_t* pa, const uint8_t* pb, int64_t nb, const int32_t* xw, const float* xa,
                   const int32_t* xo, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pa += kQ4WideBytes, pb += kQ4WideBytes, xw += 8 * MT, xa += MT, xo += MT) {
    q_prefetch(pa, pb, kQ4WideBytes);
    __m512i lo_sum[MT], hi_sum[MT];
    for (int m = 0; m < MT; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i w = q_pair(pa + 32 * i, pb + 32 * i);
      const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), m4);  // AVX512F only (epi16 needs BW)
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        lo_sum[m] = _mm512_dpbusd_epi32(lo_sum[m], lo, _mm512_set1_epi32(xw[i * MT + m]));
        hi_sum[m] = _mm512_dpbusd_epi32(hi_sum[m], hi, _mm512_set1_epi32(xw[(4 + i) * MT + m]));
      }
    }
    const __m512 d = q_pair_fp16(pa + 128, pb + 128), mn = q_pair_fp16(pa + 144, pb + 144);
    for (int m = 0; m < MT; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[m], hi_sum[m]));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(xa[m])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_castsi512_ps(_mm512_set1_epi32(xo[m])), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}

// 16 consecutive outputs v of one row -> y (fp32, or bf16 rounded to nearest even with NaN kept), plus bias[16]
// (ydtype) when given, added to y when accumulating: store_tile's arithmetic, 16 lanes at a time.
inline __m512i q_bf16_bits(__m512 x) {  // as f_to_bf16, in the low 16 bits of each lane
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
inline __m512 q_bf16_load(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}
inline void store16(const float* v, const void* bias, int ydtype, bool accumulate, void* y) {
  __m512 x = _mm512_loadu_ps(v);
  if (ydtype == 0) {
    if (bias != nullptr) x = _mm512_add_ps(x, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, accumulate ? _mm512_add_ps(_mm512_loadu_ps(y), x) : x);
    return;
  }
  if (bias != nullptr) x = _mm512_add_ps(x, q_bf16_load(bias));
  if (accumulate)  // ATen: y + round(v)
    x = _mm512_add_ps(q_bf16_load(y), _mm512_castsi512_ps(_mm512_slli_epi32(q_bf16_bits(x), 16)));
  _mm256_storeu_si256(static_cast<__m256i*>(y), _mm512_cvtepi32_epi16(q_bf16_bits(x)));
}

// fn(std::integral_constant<int, mt>) for the tile's mt rows (1 <= mt <= sizeof...(MT)): the kernel of that size.
template <int... MT, class F>
void with_rows(std::integer_sequence<int, MT...>, int mt, F fn) {
  ((mt == MT + 1 ? fn(std::integral_constant<int, MT + 1>{}) : void()), ...);
}

// Groups p, p + gb, ... (weight type 1: Q8_0, 0: Q4_1; gb bytes a group) over rows [m0, m1) of the interleaved
// activations, in tiles of at most `most` rows: two groups (np 1), or four (np 2: Q8_0 with `most` kQ8QuadTile).
// Each tile's outputs go to out[m * 16 np + r] (m < mt), then store(m, mt) for the tile's first row m.
template <class Store>
void q_wide_tiles(int wtype, int np, const uint8_t* p, int64_t gb, int64_t nb, const int32_t* xw, const float* xat,
                  const int32_t* xot, int64_t m0, int64_t m1, int most, float* out, Store store) {
  for_q_tiles(m0, m1, most, [&](int64_t m, int mt) {
    const int32_t *w = xw + m * nb * 8, *o = xot + m * nb;
    const float* a = xat + m * nb;
    if (wtype == 1 && np == 2) {
      with_rows(std::make_integer_sequence<int, kQ8QuadTile>{}, mt,
                [&](auto r) { group_q8_wide<decltype(r)::value, 2>(p, gb, nb, w, a, o, out); });
    } else if (wtype == 1) {
      with_rows(std::make_integer_sequence<int, kQ8Tile>{}, mt,
                [&](auto r) { group_q8_wide<decltype(r)::value, 1>(p, gb, nb, w, a, o, out); });
    } else {
      with_rows(std::make_integer_sequence<int, kQ4Tile>{}, mt,
                [&](auto r) { group_q4_wide<decltype(r)::value>(p, p + gb, nb, w, a, o, out); });
    }
    store(m, mt);
  });
}
#endif

}  // namespace csq
