// Phase 1 of TPP attention on bf16 chunks with AVX512-BF16: `vdpbf16ps` multiplies bf16 pairs and adds
// both products into fp32 lanes, twice the multiply-adds of an fp32 FMA per instruction, with no
// conversion of the keys. Included by run_cpu.cpp; compiled in only where -march=native has AVX512-BF16.
//
// Pair layouts (a pair is two bf16 in one 32-bit word, the lower one first):
//   queries  qp [d/2, MB]: (q[x, 2i], q[x, 2i + 1])  -- lanes over rows x, pairs over the head dim
//   keys     the pool's rows as they lie: k[t, 2i], k[t, 2i + 1] are already a pair
//   probs    pp [ceil(nt/2), MB]: (p[x, 2s], p[x, 2s + 1])  -- pairs over keys, written by the softmax
//   values   vp [ceil(nt/2), d]: (v[2s, j], v[2s + 1, j])   -- lanes over the head dim, pairs over keys
// Scores S^T [t, rows] = K Q^T and O [rows, d] += P V use the same register tiles as the fp32 kernel.
// Queries and probabilities are rounded to bf16 (round to nearest even) before they are multiplied, as
// a bf16 GPU kernel does; sums stay fp32. The queries are packed unscaled, so a bf16 model's queries are
// exact, and the softmax scale multiplies the fp32 scores. Only valid key slots are read: an odd last pair's second
// value and probability are zero.
#pragma once
#include <cstdint>

#include "simd.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define CS_RUN_DPBF16 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace cs_dp {

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __m512bh bcast(const uint32_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return as_bh(_mm512_set1_epi32(x));
}
inline __m512bh loadp(const uint32_t* p) { return as_bh(_mm512_loadu_si512(p)); }

// st[t * MB + x] = scale * q_x . k_t for nt keys; qp [d/2, MB] pairs, kc: nt bf16 rows of d (d even). Only the
// first NF vectors of rows, and with H the next 8 rows in a half vector, are computed (a run's last row block
// holds fewer than MB rows: 8 chats of a 3-head group are 24 rows of a 32-row block); the other lanes of st
// keep what they held. mx[x] gets each computed row's largest score (the softmax's max, taken as the scores
// are stored instead of in a second pass over st).
template <int MB, int KU, int NF, bool H>
__attribute__((noinline)) void scores_pairs(const uint32_t* qp, const uint16_t* kc, int64_t nt, int64_t d,
                                            float scale, float* st, float* mx) {
  static_assert(NF * 16 + (H ? 8 : 0) <= MB && NF >= 1, "the computed rows must fit the block");
  const int64_t dh = d / 2;
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mv[NF];
  __m256 mh = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < NF; ++v) mv[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + KU <= nt; t += KU) {
    __m512 a[KU][NF];
    __m256 ah[KU];
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) {
#pragma GCC unroll 3
      for (int v = 0; v < NF; ++v) a[u][v] = _mm512_setzero_ps();
      if constexpr (H) ah[u] = _mm256_setzero_ps();
    }
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(kc + t * d);  // key t + u, pair i: kr[u * dh + i]
    if (t + 2 * KU <= nt)  // the next tile's keys into L1
      for (int64_t off = 0; off < KU * d * 2; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(kr) + KU * d * 2 + off, 0, 3);
    for (int64_t i = 0; i < dh; ++i) {
      __m512bh q[NF];
      __m256bh qh;
#pragma GCC unroll 3
      for (int v = 0; v < NF; ++v) q[v] = loadp(qp + i * MB + v * 16);
      if constexpr (H) qh = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + i * MB + NF * 16));
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) {
        const __m512bh kb = bcast(kr + u * dh + i);
#pragma GCC unroll 3
        for (int v = 0; v < NF; ++v) a[u][v] = _mm512_dpbf16_ps(a[u][v], q[v], kb);
        if constexpr (H) ah[u] = _mm256_dpbf16_ps(ah[u], qh, (__m256bh)_mm512_castsi512_si256((__m512i)kb));
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) {
#pragma GCC unroll 3
      for (int v = 0; v < NF; ++v) {
        const __m512 s = _mm512_mul_ps(a[u][v], sc);
        mv[v] = _mm512_max_ps(mv[v], s);
        _mm512_storeu_ps(st + (t + u) * MB + v * 16, s);
      }
      if constexpr (H) {
        const __m256 s = _mm256_mul_ps(ah[u], _mm512_castps512_ps256(sc));
        mh = _mm256_max_ps(mh, s);
        _mm256_storeu_ps(st + (t + u) * MB + NF * 16, s);
      }
    }
  }
  for (; t < nt; ++t) {
    __m512 a[NF];
    __m256 ah = _mm256_setzero_ps();
    for (int v = 0; v < NF; ++v) a[v] = _mm512_setzero_ps();
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(kc + t * d);
    for (int64_t i = 0; i < dh; ++i) {
      const __m512bh kb = bcast(kr + i);
      for (int v = 0; v < NF; ++v) a[v] = _mm512_dpbf16_ps(a[v], loadp(qp + i * MB + v * 16), kb);
      if constexpr (H)
        ah = _mm256_dpbf16_ps(ah, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + i * MB + NF * 16)),
                              (__m256bh)_mm512_castsi512_si256((__m512i)kb));
    }
    for (int v = 0; v < NF; ++v) {
      const __m512 s = _mm512_mul_ps(a[v], sc);
      mv[v] = _mm512_max_ps(mv[v], s);
      _mm512_storeu_ps(st + t * MB + v * 16, s);
    }
    if constexpr (H) {
      const __m256 s = _mm256_mul_ps(ah, _mm512_castps512_ps256(sc));
      mh = _mm256_max_ps(mh, s);
      _mm256_storeu_ps(st + t * MB + NF * 16, s);
    }
  }
  for (int v = 0; v < NF; ++v) _mm512_storeu_ps(mx + v * 16, mv[v]);
  if constexpr (H) _mm256_storeu_ps(mx + NF * 16, mh);
}

// The scores of a row block's first `rows` rows (`scores_pairs` over the fewest vectors that cover them).
template <int MB, int KU>
inline void scores_rows(int64_t rows, const uint32_t* qp, const uint16_t* kc, int64_t nt, int64_t d, float scale,
                        float* st, float* mx) {
  if constexpr (MB == 32) {
    if (rows <= 16) return scores_pairs<32, KU, 1, false>(qp, kc, nt, d, scale, st, mx);
    if (rows <= 24) return scores_pairs<32, KU, 1, true>(qp, kc, nt, d, scale, st, mx);
    return scores_pairs<32, KU, 2, false>(qp, kc, nt, d, scale, st, mx);
  } else {
    static_assert(MB == 48, "row blocks of 2 or 3 vectors");
    if (rows <= 16) return scores_pairs<48, KU, 1, false>(qp, kc, nt, d, scale, st, mx);
    if (rows <= 24) return scores_pairs<48, KU, 1, true>(qp, kc, nt, d, scale, st, mx);
    if (rows <= 32) return scores_pairs<48, KU, 2, false>(qp, kc, nt, d, scale, st, mx);
    if (rows <= 40) return scores_pairs<48, KU, 2, true>(qp, kc, nt, d, scale, st, mx);
    return scores_pairs<48, KU, 3, false>(qp, kc, nt, d, scale, st, mx);
  }
}

// acc [MB, d] += P V with pp [np, MB] and vp [np, d] pairs (np = ceil(nt / 2)); d % 16 == 0. Only the row tiles
// that hold the block's first `rows` rows.
template <int MB, int RU>
__attribute__((noinline)) void pv_pairs(const uint32_t* pp, const uint32_t* vp, int64_t np, int64_t d, float* acc,
                                        int64_t rows) {
  for (int64_t x = 0; x < rows; x += RU) {
    float* o = acc + x * d;  // row x + u at o[u * d]
    int64_t jd = 0;
    for (; jd + 32 <= d; jd += 32) {
      __m512 a[RU][2];
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) {
        a[u][0] = _mm512_loadu_ps(o + u * d + jd);
        a[u][1] = _mm512_loadu_ps(o + u * d + jd + 16);
      }
      for (int64_t s = 0; s < np; ++s) {
        const __m512bh v0 = loadp(vp + s * d + jd), v1 = loadp(vp + s * d + jd + 16);
        const uint32_t* p = pp + s * MB + x;
#pragma GCC unroll 8
        for (int u = 0; u < RU; ++u) {
          const __m512bh pb = bcast(p + u);
          a[u][0] = _mm512_dpbf16_ps(a[u][0], v0, pb);
          a[u][1] = _mm512_dpbf16_ps(a[u][1], v1, pb);
        }
      }
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) {
        _mm512_storeu_ps(o + u * d + jd, a[u][0]);
        _mm512_storeu_ps(o + u * d + jd + 16, a[u][1]);
      }
    }
    for (; jd < d; jd += 16) {
      __m512 a[RU];
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) a[u] = _mm512_loadu_ps(o + u * d + jd);
      for (int64_t s = 0; s < np; ++s) {
        const __m512bh v0 = loadp(vp + s * d + jd);
#pragma GCC unroll 8
        for (int u = 0; u < RU; ++u) a[u] = _mm512_dpbf16_ps(a[u], v0, bcast(pp + s * MB + x + u));
      }
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) _mm512_storeu_ps(o + u * d + jd, a[u]);
    }
  }
}

// vp [ceil(nt/2), d] pairs of value rows (2s, 2s + 1) from nt bf16 rows of d; d % 16 == 0.
inline void pack_values(const uint16_t* vc, int64_t nt, int64_t d, uint32_t* vp) {
  for (int64_t t = 0; t < nt; t += 2) {
    const uint16_t* r0 = vc + t * d;
    const uint16_t* r1 = r0 + d;
    uint32_t* out = vp + (t / 2) * d;
    for (int64_t j = 0; j < d; j += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j)));
      const __m512i hi = t + 1 < nt
          ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + j))), 16)
          : _mm512_setzero_si512();
      _mm512_storeu_si512(out + j, _mm512_or_si512(lo, hi));
    }
  }
}

// exp(x) for x <= 0 to 6e-5 relative (a thirtieth of bf16's half ulp, which the probabilities are rounded to):
// x = n ln2 + r with |r| <= ln2/2 (ln2 as one fp32 constant), a degree-4 Taylor polynomial in r, scaled by 2^n with
// vscalefps (which also underflows to 0 without bit tricks). A degree-5 polynomial and a two-constant reduction
// (3e-6) cost 2 % more in the GQA call at full sharing.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));  // exp(-100) is 0 in bf16; keeps r and p small
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(1.f / 24);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Column o (16 rows) of the probabilities exp(st[t] - mn), t < nt, as bf16 pairs into pp [ceil(nt/2), MB];
// returns their fp32 sum (before rounding).
template <int MB>
inline cs::vf exp_pairs(const float* st, int64_t nt, int64_t o, cs::vf mn, uint32_t* pp, cs::Spread& pf) {
  const __m512i kInterleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                               22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  cs::vf sum{};
  for (int64_t t = 0; t < nt; t += 2) {
    pf.step();
    const cs::vf e0 = (cs::vf)exp16((__m512)(cs::load(st + t * MB + o) - mn));
    const cs::vf e1 = t + 1 < nt ? (cs::vf)exp16((__m512)(cs::load(st + (t + 1) * MB + o) - mn)) : cs::vf{};
    sum += e0 + e1;
    // words [e0[0..15], e1[0..15]] (nearest even) -> pairs (e0[x], e1[x]) in 32-bit lane x
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);
    _mm512_storeu_si512(pp + (t / 2) * MB + o, _mm512_permutexvar_epi16(kInterleave, both));
  }
  return sum;
}

}  // namespace cs_dp
#else
namespace cs_dp {  // declarations only: the callers' discarded `if constexpr` branches name them
template <int MB, int KU> void scores_rows(int64_t, const uint32_t*, const uint16_t*, int64_t, int64_t, float, float*,
                                           float*);
template <int MB, int RU> void pv_pairs(const uint32_t*, const uint32_t*, int64_t, int64_t, float*, int64_t);
void pack_values(const uint16_t*, int64_t, int64_t, uint32_t*);
template <int MB> cs::vf exp_pairs(const float*, int64_t, int64_t, cs::vf, uint32_t*, cs::Spread&);
}  // namespace cs_dp
#endif
