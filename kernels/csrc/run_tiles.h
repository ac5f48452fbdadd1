// fp32 register tiles of the CPU phase-1 kernel (run_cpu.cpp): scores S^T = K Q^T and O += P V over one
// chunk for a block of MB = NV * kW query rows. Included by run_cpu.cpp.
#pragma once
#include <cstdint>

#include "simd.h"

namespace cs_tiles {

using cs::kW;
using cs::vf;

// Register tiles. A row block holds MB = NV * kW query rows. Scores: KU keys x NV vectors of rows;
// P@V: RU rows x 2 vectors of D. Both keep 8-16 accumulators and load about 2 values per 3 FMAs. With 512-bit
// vectors, 2-vector blocks take 16 (8 keys, 8 rows): a core that issues two 512-bit FMAs a cycle with a 4-cycle
// latency (Zen 5) needs 8 in flight, and 8 left the P@V tile no slack (fp32 GQA decode 6-7 % faster there).
template <int NV> struct Tile {
  static constexpr int64_t MB = NV * kW;
  static constexpr int KU = NV == 3 ? 4 : (kW == 16 ? 8 : 6);
  static constexpr int RU = NV == 3 ? 6 : (kW == 16 ? 8 : 4);
  static_assert(MB % RU == 0, "row block must split into P@V row tiles");
};

// st[t * MB + x] = q_x . k_t for nt keys (qt: [d, MB], keys row-major [nt, d]); mx[x] = the row's largest score.
template <int NV>
__attribute__((noinline)) void scores(const float* qt, const float* kc, int64_t nt, int64_t d, float* st, float* mx,
                                      cs::Spread& pf) {
  constexpr int64_t MB = Tile<NV>::MB;
  constexpr int KU = Tile<NV>::KU;
  vf mv[NV];
  for (int v = 0; v < NV; ++v) mv[v] = cs::splat(-__builtin_inff());
  int64_t t = 0;
  for (; t + KU <= nt; t += KU) {
    vf a[KU][NV] = {};
    const float* kr = kc + t * d;  // key t + u at kr[u * d + j]
    for (int64_t j = 0; j < d; ++j, ++kr) {
      pf.step();
      vf q[NV];
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) { q[v] = cs::load(qt + j * MB + v * kW); cs::keep(q[v]); }
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) {
        const float x = kr[u * d];
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) a[u][v] += x * q[v];
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u)
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) {
        mv[v] = cs::vmax(mv[v], a[u][v]);
        cs::store(st + (t + u) * MB + v * kW, a[u][v]);
      }
  }
  for (; t < nt; ++t) {
    vf a[NV] = {};
    const float* kt = kc + t * d;
    for (int64_t j = 0; j < d; ++j)
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) a[v] += kt[j] * cs::load(qt + j * MB + v * kW);
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      mv[v] = cs::vmax(mv[v], a[v]);
      cs::store(st + t * MB + v * kW, a[v]);
    }
  }
  for (int v = 0; v < NV; ++v) cs::store(mx + v * kW, mv[v]);
}

// acc [MB, d] += P [MB, nt] V [nt, d], P given transposed (st[t * MB + x]); d % kW == 0.
template <int NV>
__attribute__((noinline)) void pv(const float* st, const float* vc, int64_t nt, int64_t d, float* acc) {
  constexpr int64_t MB = Tile<NV>::MB;
  constexpr int RU = Tile<NV>::RU;
  for (int64_t x = 0; x < MB; x += RU) {
    float* o = acc + x * d;  // row x + u at o[u * d]
    int64_t jd = 0;
    for (; jd + 2 * kW <= d; jd += 2 * kW) {
      vf a[RU][2];
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) { a[u][0] = cs::load(o + u * d + jd); a[u][1] = cs::load(o + u * d + jd + kW); }
      for (int64_t t = 0; t < nt; ++t) {
        vf v0 = cs::load(vc + t * d + jd), v1 = cs::load(vc + t * d + jd + kW);
        cs::keep(v0);
        cs::keep(v1);
        const float* p = st + t * MB + x;
#pragma GCC unroll 8
        for (int u = 0; u < RU; ++u) { a[u][0] += p[u] * v0; a[u][1] += p[u] * v1; }
      }
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) { cs::store(o + u * d + jd, a[u][0]); cs::store(o + u * d + jd + kW, a[u][1]); }
    }
    for (; jd < d; jd += kW) {
      vf a[RU];
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) a[u] = cs::load(o + u * d + jd);
      for (int64_t t = 0; t < nt; ++t) {
        const vf v0 = cs::load(vc + t * d + jd);
        const float* p = st + t * MB + x;
#pragma GCC unroll 8
        for (int u = 0; u < RU; ++u) a[u] += p[u] * v0;
      }
#pragma GCC unroll 8
      for (int u = 0; u < RU; ++u) cs::store(o + u * d + jd, a[u]);
    }
  }
}

}  // namespace cs_tiles
