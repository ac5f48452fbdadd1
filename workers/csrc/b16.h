// bf16 weights for the block kernel (qmatmul.cpp, weight type 2): y = x . W^T with W kept in bf16, x rounded
// to bf16, products summed in fp32. One bf16 row of a decode step reads every weight once, so on a CPU this
// is a memory-bound pass over the weights; oneDNN's blocked bf16 kernel spends its time elsewhere at one row.
//
// Packed layout: groups of 8 output rows (N padded with zero rows), blocks of 32 along K, 512 bytes a block:
// 16 vectors of 32 bytes, vector i = (w[r][2i], w[r][2i + 1]) for the 8 rows r, one 4-byte lane a row, so a
// lane holds the pair that one `vdpbf16ps` lane multiplies by the broadcast activation pair (x[2i], x[2i + 1]).
// With AVX512-BF16 (and VL) that is one instruction per vector and activation row; on AVX2 the pair is
// widened to two fp32 vectors (shift / mask) and two FMAs; elsewhere a scalar loop. The three forms can
// differ in the last bits of a sum (vdpbf16ps's own rounding of its pair); each is deterministic and
// batch-invariant: every output is the same sum in the same order whatever M and the threads.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

#include "qact.h"

namespace csq {

constexpr int64_t kB16Bytes = 512;  // one block of 8 rows x 32 values

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define CS_B16_NATIVE 1
#else
#define CS_B16_NATIVE 0
#endif

// Without AVX512-BF16: 8 rows of one group x MT activation rows (bf16, row stride K); out[m * ldo + r]. Each row
// sums into two accumulators (even and odd elements of the pairs), added at the end. (The native tiles are below.)
template <int MT>
void group_b16(const uint8_t* pw, int64_t nb, const uint16_t* x, int64_t K, float* out, int64_t ldo) {
#if CS_Q_AVX2
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t b = 0; b < nb; ++b, pw += kB16Bytes) {
    for (int64_t c = 0; c < kB16Bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(pw) + 4096 + c, _MM_HINT_T0);
    const uint16_t* xb = x + b * kBlock;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 32 * i));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));  // w[r][2i] as fp32
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));  // w[r][2i + 1]
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xp = xb + m * K + 2 * i;
        acc[m][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(bf16_to_f(xp[0])), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(bf16_to_f(xp[1])), acc[m][1]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, _mm256_add_ps(acc[m][0], acc[m][1]));
#else
  float acc[MT][2][8] = {};
  for (int64_t b = 0; b < nb; ++b, pw += kB16Bytes) {
    const uint16_t* wv = reinterpret_cast<const uint16_t*>(pw);  // [16 pairs][8 rows][2]
    for (int i = 0; i < 16; ++i)
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xp = x + m * K + b * kBlock + 2 * i;
        for (int r = 0; r < 8; ++r) {
          acc[m][0][r] = std::fma(bf16_to_f(wv[(i * 8 + r) * 2]), bf16_to_f(xp[0]), acc[m][0][r]);
          acc[m][1][r] = std::fma(bf16_to_f(wv[(i * 8 + r) * 2 + 1]), bf16_to_f(xp[1]), acc[m][1][r]);
        }
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][0][r] + acc[m][1][r];
#endif
}

#if CS_B16_NATIVE
// The native tiles read their activation rows interleaved: word p * S + m is row m's pair p = (x[m][2p],
// x[m][2p + 1]), S slots a pair (the tile's rows; 16 for the wide tile, zero past its rows), so every broadcast or
// load sits at a constant offset from one pointer (with a pointer per row the tile spilled its registers and
// loaded twice per product). Each output sums its even and its odd pairs in two chains, added at the end, in
// every tile: a row's outputs are the same bits in any batch, and one row keeps two chains in flight over one
// stream of weights (one chain, or several groups at once, fell from ~27 to 12-21 GB/s at one row on Zen 4).
// Bytes ahead of the block being read: bf16 decode steps of 4 / 8 rows (Zen 5, one thread) 8.7-9.2 / 12.1-13.0 ms
// against 9.7-10.0 / 13.1-13.6 ms at 4 KiB (one row unchanged: at memory speed either way).
constexpr int64_t kB16Prefetch = 8192;
constexpr int64_t kB16MaxTile = 16;  // rows per tile at most
constexpr int kB16Wide = 13;  // tiles of this many rows or more take the wide kernel (lanes over 16 rows)

constexpr int b16_slots(int mt) { return mt >= kB16Wide ? static_cast<int>(kB16MaxTile) : mt; }

// mt rows of bf16 x (row stride K) -> xi [K / 2, b16_slots(mt)] pairs (zero past row mt).
inline void interleave_b16(const uint16_t* x, int64_t K, int mt, uint32_t* xi) {
  const int S = b16_slots(mt);
  if (S > mt) std::memset(xi, 0, sizeof(uint32_t) * S * (K / 2));
  for (int m = 0; m < mt; ++m)
    for (int64_t p = 0; p < K / 2; ++p) std::memcpy(xi + p * S + m, x + m * K + 2 * p, 4);
}

// Narrow tile: 8 output rows of one group (the lanes) x MT activation rows; out[m * ldo + r].
template <int MT>
void group_b16_native(const uint8_t* pw, int64_t nb, const uint32_t* xi, float* out, int64_t ldo) {
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pw += kB16Bytes, xi += 16 * MT) {
    for (int64_t c = 0; c < kB16Bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(pw) + kB16Prefetch + c, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m256bh w = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 32 * i));
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
        acc[m][i & 1] = _mm256_dpbf16_ps(acc[m][i & 1], w, (__m256bh)_mm256_set1_epi32(static_cast<int32_t>(xi[i * MT + m])));
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, _mm256_add_ps(acc[m][0], acc[m][1]));
}

// Wide tile: 16 activation rows (the lanes; rows past mt are zero) x the 8 output rows of one group, each weight
// pair broadcast once for all 16 rows; the same per-lane sums as the narrow tile. out[m * ldo + r], m < mt.
inline void group_b16_wide(const uint8_t* pw, int64_t nb, const uint32_t* xi, int mt, float* out, int64_t ldo) {
  __m512 acc[8][2];
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pw += kB16Bytes, xi += 16 * kB16MaxTile) {
    for (int64_t c = 0; c < kB16Bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(pw) + kB16Prefetch + c, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xi + i * kB16MaxTile);
      const uint8_t* wv = pw + 32 * i;  // the 8 output rows' pairs, 4 bytes each
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        int32_t wp;
        std::memcpy(&wp, wv + 4 * r, 4);
        acc[r][i & 1] = _mm512_dpbf16_ps(acc[r][i & 1], xv, (__m512bh)_mm512_set1_epi32(wp));
      }
    }
  }
  alignas(64) float t[8][16];
  for (int r = 0; r < 8; ++r) _mm512_store_ps(t[r], _mm512_add_ps(acc[r][0], acc[r][1]));
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = t[r][m];
}

// The native tiles of rows [m0, m1), a piece of at most `piece` rows starting at a multiple of it, in order:
// fn(m, mt, xi offset in words). Each piece's interleaved rows start at their own slot, padding included.
template <class F>
void for_b16_tiles(int64_t m0, int64_t m1, int64_t K, int64_t piece, F fn) {
  int64_t off = m0 / piece * (piece + kB16MaxTile) * (K / 2);
  for (int64_t m = m0; m < m1;) {
    const int mt = tile_rows(m1 - m, kB16MaxTile);
    fn(m, mt, off);
    off += b16_slots(mt) * (K / 2);
    m += mt;
  }
}

// Words of interleaved activations for M rows in pieces of `piece` (`for_b16_tiles`).
constexpr int64_t b16_interleaved_words(int64_t M, int64_t K, int64_t piece) {
  return (M + piece - 1) / piece * (piece + kB16MaxTile) * (K / 2);
}

// Rows [m0, m1) of bf16 x (row stride K) interleaved tile by tile into xi.
inline void interleave_b16_tiles(const uint16_t* x, int64_t K, int64_t m0, int64_t m1, int64_t piece, uint32_t* xi) {
  for_b16_tiles(m0, m1, K, piece, [&](int64_t m, int mt, int64_t off) { interleave_b16(x + m * K, K, mt, xi + off); });
}

template <int... MT>
void b16_narrow(std::integer_sequence<int, MT...>, int mt, const uint8_t* pw, int64_t nb, const uint32_t* xi,
                float* out) {
  ((mt == MT + 1 ? group_b16_native<MT + 1>(pw, nb, xi, out, 8) : void()), ...);
}

// One group (pw: its nb blocks) over rows [m0, m1) of the interleaved activations xi: each tile's outputs go to
// out[m * 8 + r] (m < mt), then store(m, mt) for the tile's first row m.
template <class Store>
void b16_tiles(const uint8_t* pw, int64_t nb, const uint32_t* xi, int64_t K, int64_t m0, int64_t m1, int64_t piece,
               float* out, Store store) {
  for_b16_tiles(m0, m1, K, piece, [&](int64_t m, int mt, int64_t off) {
    if (mt >= kB16Wide) {
      group_b16_wide(pw, nb, xi + off, mt, out, 8);
    } else {
      b16_narrow(std::make_integer_sequence<int, kB16Wide - 1>{}, mt, pw, nb, xi + off, out);
    }
    store(m, mt);
  });
}
#endif

// One row of K fp32 values -> K bf16 (round to nearest even).
inline void bf16_row(const float* f, int64_t K, uint16_t* q) {
  for (int64_t j = 0; j < K; ++j) q[j] = f_to_bf16(f[j]);
}

}  // namespace csq
