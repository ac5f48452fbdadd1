// chunkserve CPU phase 1 of TPP attention: every shared run's stacked queries against its chunks.
//
// A run covers batch rows [i, j) of a decode batch and a list of chunks they all share. For each KV
// head, its M = (j - i) * g query rows (the rows' GQA heads of that KV head) attend the run's keys
// together, so each key and value is loaded once per run instead of once per row: the matrix-matrix
// form of the paper's chunk-first phase. Work items are (run, kv head, split of the run's chunks).
// Inside an item, per chunk: scores S^T [t, rows] = K Q^T by a 4-key x 2-vector register tile over
// rows pre-transposed to Q^T [D, rows], which also keeps each row's max as it stores the scores; online
// softmax vectorised across rows (one exp per score); then O [rows, D] += P V by a 4-row x 2-vector tile
// (fp32 tiles and bf16 pairs prefetch the next chunk meanwhile). Only valid token slots are read.
// Output, per run r: normalised o in slot r of [R, b, Hkv, g, D] and lse in [R, b, Hkv, g] (rows
// [i, j) only; other rows of the slot are left untouched), or with kOneSlot all in slot 0 (runs over
// disjoint rows: a prefill step's tokens). With kAccumulate (one slot only) a row's partial is merged by
// log-sum-exp into the normalised (o, lse) already there instead of overwriting it, so a caller that holds
// another partial of the same rows needs no scratch and no separate merge. Splits are merged likewise.
// Causal runs (qpos; a prefill step's pieces of a request's tokens, one split): row x sees only the run's keys
// before qpos + x / g + 1; the kernel masks the chunk where that limit falls in a row block and skips the chunks no
// row of the block sees (the AMX tiles mask in run_amx.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include <omp.h>

#include "run_amx.h"
#include "run_args.h"
#include "run_bf16.h"
#include "run_scratch.h"
#include "run_tiles.h"
#include "simd.h"

namespace {

using cs::kW, cs::vf;
using cs_run::finish_item, cs_run::kAccumulate, cs_run::kQBufMax, cs_run::kOneSlot, cs_run::kOutBf16, cs_run::kQBf16, cs_run::kRawQ,
    cs_run::merge, cs_run::qpre, cs_run::qrow, cs_run::RunArgs;
using cs_dp::exp_pairs, cs_dp::pack_values, cs_dp::pv_pairs, cs_dp::scores_rows;
using cs_tiles::pv, cs_tiles::scores, cs_tiles::Tile;

// bf16 chunks multiply bf16 pairs with vdpbf16ps where the CPU has it (run_bf16.h), else fp32 FMAs.
#ifdef CS_RUN_DPBF16
template <typename T> constexpr bool kPairs = std::is_same_v<T, cs::Bf16> && kW == 16;
#else
template <typename T> constexpr bool kPairs = false;
#endif
// their tiles: 16 accumulators for 2-vector row blocks, 12 for 3; key tiles that divide a 64-token chunk
template <int NV> constexpr int kPairKU = NV == 3 ? 4 : 8;
template <int NV> constexpr int kPairRU = NV == 3 ? 6 : 8;
// The softmax's vectors for a block of `rows` rows in the pair path: those of every P@V row tile that holds them.
template <int NV> constexpr int64_t pair_vectors(int64_t rows) {
  return ((rows + kPairRU<NV> - 1) / kPairRU<NV> * kPairRU<NV> + kW - 1) / kW;
}

template <typename T>
const float* as_f32(const T* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t x = 0; x < n; ++x) buf[x] = cs::to_f(src[x]);
    return buf.data();
  }
}


#ifdef CS_RUN_AMX
// run_item on bf16 chunks with AMX tiles (run_amx.h): the same (acc, m, l) per row, in 16-row blocks.
void run_item_amx(const RunArgs& a, int64_t r, int64_t h, int64_t s, Scratch& w) {
  const int64_t d = a.d, i = a.rows[2 * r], M = (a.rows[2 * r + 1] - i) * a.g, nrb = (M + 15) / 16;
  const __m512 rs = _mm512_set1_ps(1.f / a.qscale), pre = _mm512_set1_ps(qpre(a));  // as in run_item
  uint16_t* qb = w.qb.data();
  for (int64_t x = 0; x < nrb * 16; ++x) {
    if (x >= M) {
      std::memset(qb + x * d, 0, sizeof(uint16_t) * d);
      continue;
    }
    alignas(64) float qbuf[kQBufMax];
    const float* src = qrow(a, i, h, x, qbuf);
    for (int64_t j = 0; j < d; j += 16) {  // nearest even, as cs::bf16_bits
      const __m512 qv = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(src + j), pre), rs);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + x * d + j), (__m256i)_mm512_cvtneps_pbh(qv));
    }
  }
  float *acc = w.acc.data(), *m = w.m.data(), *l = w.l.data();
  std::fill(m, m + nrb * 16, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nrb * 16, 0.f);
  cs_amx::Segment seg{0, {}, {}, w.kt.data(), w.vp.data()};
  const cs_amx::Buffers buf{w.st.data(), w.pb.data(), w.qt.data()};
  int32_t* lim = a.qpos != nullptr ? w.lim.data() : nullptr;  // causal: token x / g sees its run's keys up to its own
  for (int64_t x = 0; lim != nullptr && x < nrb * 16; ++x) lim[x] = x < M ? a.qpos[r] + x / a.g + 1 : 1 << 30;
  auto flush = [&]() {
    for (int64_t rb = 0; rb < nrb && seg.nblk > 0; rb += 2)  // row blocks in pairs, a lone last one alone
      (rb + 1 < nrb ? cs_amx::seg_rows<2> : cs_amx::seg_rows<1>)(seg, qb + rb * 16 * d, d, a.qscale, buf,
                                                                  lim ? lim + rb * 16 : nullptr, acc + rb * 16 * d,
                                                                  m + rb * 16, l + rb * 16);
    const int64_t keys = seg.nblk ? seg.start[seg.nblk - 1] + seg.valid[seg.nblk - 1] : 0;
    for (int64_t x = 0; lim != nullptr && x < nrb * 16; ++x)
      lim[x] -= static_cast<int32_t>(std::min<int64_t>(keys, lim[x]));  // now relative to the next segment
    seg.nblk = 0;
  };
  const int64_t c0 = a.cptr[r], P = a.cptr[r + 1] - c0;
  const int64_t cps = (P + a.nsplit - 1) / a.nsplit, p0 = s * cps, p1 = std::min(P, p0 + cps);
  const uint16_t* kbase = static_cast<const uint16_t*>(a.k) + h * a.hs;
  const uint16_t* vbase = static_cast<const uint16_t*>(a.v) + h * a.hs;
  cs_amx::configure();
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t nt = a.tokens[c0 + p], ch = a.chunks[c0 + p];
    for (int64_t t0 = 0; t0 < nt; t0 += cs_amx::kKeys) {
      if (seg.nblk == cs_amx::kSegBlocks) flush();
      cs_amx::add_block(seg, kbase + ch * a.cs + t0 * d, vbase + ch * a.cs + t0 * d,
                        std::min(cs_amx::kKeys, nt - t0), d);
    }
  }
  flush();
  _tile_release();
  finish_item(a, r, h, s, acc, m, l);
}
#endif

// Causal runs: in a chunk's scores st [nt, MB], key t of row x (x < rows) counts only below seen(x); the others
// become -inf and each computed row's max (rmax, lanes < lanes) is taken again over the keys it sees.
template <class Seen>
void mask_scores(float* st, float* rmax, int64_t nt, int64_t rows, int64_t lanes, int64_t MB, Seen seen) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < lanes; ++x) {
    const int64_t cut = x < rows ? std::clamp<int64_t>(seen(x), 0, nt) : nt;
    float mx = ninf;
    for (int64_t t = 0; t < cut; ++t) mx = std::max(mx, st[t * MB + x]);
    for (int64_t t = cut; t < nt; ++t) st[t * MB + x] = ninf;
    if (x < rows) rmax[x] = mx;
  }
}

template <typename T, int NV>
void run_item(const RunArgs& a, int64_t r, int64_t h, int64_t s, Scratch& w) {
#ifdef CS_RUN_AMX
  if constexpr (kPairs<T>)
    if (cs_amx::usable(a.d)) return run_item_amx(a, r, h, s, w);
#endif
  constexpr int64_t MB = Tile<NV>::MB;
  const int64_t d = a.d, i = a.rows[2 * r], M = (a.rows[2 * r + 1] - i) * a.g;
  const int64_t nrb = (M + MB - 1) / MB, Mp = nrb * MB;
  const float ninf = -std::numeric_limits<float>::infinity();
  float* qt = w.qt.data();  // [nrb, d, MB] fp32, or [nrb, d/2, MB] bf16 pairs
  uint32_t* qp = reinterpret_cast<uint32_t*>(qt);
  const float rs = 1.f / a.qscale, pre = qpre(a);  // a bf16 model's queries come back: q * s * (1 / s) rounds to q
  alignas(64) float qbuf[kQBufMax];
  for (int64_t rb = 0; rb < nrb; ++rb)
    for (int64_t x = 0; x < MB; ++x) {
      const int64_t row = rb * MB + x;
      const float* src = row < M ? qrow(a, i, h, row, qbuf) : nullptr;
      if constexpr (kPairs<T>) {
        for (int64_t j = 0; j < d; j += 2)
          qp[(rb * d / 2 + j / 2) * MB + x] =
              src ? cs::bf16_bits(src[j] * pre * rs) | static_cast<uint32_t>(cs::bf16_bits(src[j + 1] * pre * rs)) << 16
                  : 0u;
      } else {
        for (int64_t j = 0; j < d; ++j) qt[(rb * d + j) * MB + x] = src ? src[j] * pre : 0.f;
      }
    }
  float *acc = w.acc.data(), *m = w.m.data(), *l = w.l.data(), *st = w.st.data();
  std::memset(acc, 0, sizeof(float) * Mp * d);
  for (int64_t x = 0; x < Mp; ++x) { m[x] = ninf; l[x] = 0.f; }
  alignas(64) float rmax[MB];  // row maxima of a chunk's scores, stored with them (lanes never computed stay -inf)
  std::fill(rmax, rmax + MB, ninf);
  const int64_t c0 = a.cptr[r], P = a.cptr[r + 1] - c0;
  const int64_t cps = (P + a.nsplit - 1) / a.nsplit, p0 = s * cps, p1 = std::min(P, p0 + cps);
  const T* kbase = static_cast<const T*>(a.k) + h * a.hs;
  const T* vbase = static_cast<const T*>(a.v) + h * a.hs;
  // causal runs (qpos, one split): row x sees the run's keys before lim(x) = qpos + x / g + 1; kofs counts the keys
  // of the chunks before this one
  const bool causal = a.qpos != nullptr;
  auto lim = [&](int64_t x) { return a.qpos[r] + x / a.g + 1; };
  int64_t kofs = 0;
  for (int64_t p = p0; p < p1; kofs += a.tokens[c0 + p], ++p) {
    const int64_t nt = a.tokens[c0 + p];
    if (nt <= 0) continue;
    if (causal && kofs >= lim(M - 1)) break;  // no row sees this chunk or any after it
    const int64_t ch = a.chunks[c0 + p];
    // the next chunk's K and V into L1 as this chunk runs (fp32 tiles and bf16 pairs read them where they lie; a
    // burst at the chunk's start left most of it unfetched): spread over the head-dim steps of the fp32 score tile,
    // or over the bf16 pairs' softmax (a vector of two keys' probabilities a step), each the placement that measured
    // fastest for its path (the paths that convert a chunk first, fp16 and bf16 without vdpbf16ps, were not measured)
    cs::Spread pf;
    if constexpr (std::is_same_v<T, float> || kPairs<T>)
      if (p + 1 < p1 && a.tokens[c0 + p + 1] > 0) {
        const int64_t nx = a.chunks[c0 + p + 1] * a.cs;
        int64_t steps = 0;
        for (int64_t rb = 0; rb < nrb; ++rb)  // the softmax's vectors per row block (as in the loop below)
          steps += kPairs<T> ? pair_vectors<NV>(std::min<int64_t>(MB, M - rb * MB)) * ((nt + 1) / 2)
                             : (nt / Tile<NV>::KU) * d;
        const int64_t lines = (a.tokens[c0 + p + 1] * d * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        pf.k = reinterpret_cast<const char*>(kbase + nx), pf.v = reinterpret_cast<const char*>(vbase + nx);
        pf.left = lines, pf.every = std::max<int64_t>(1, steps / lines);
        if (steps == 0) cs::prefetch_kv<3>(kbase + nx, vbase + nx, a.tokens[c0 + p + 1] * d), pf.left = 0;
      }
    const float* kc = nullptr;
    const float* vc = nullptr;
    if constexpr (kPairs<T>) {
      pack_values(reinterpret_cast<const uint16_t*>(vbase + ch * a.cs), nt, d, w.vp.data());
    } else {
      kc = as_f32(kbase + ch * a.cs, nt * d, w.kf);
      vc = as_f32(vbase + ch * a.cs, nt * d, w.vf_);
    }
    for (int64_t rb = 0; rb < nrb; ++rb) {
      // the block's rows (the last block of a run may hold fewer than MB); the bf16 pair path computes only the
      // vectors and P@V row tiles that hold them (the other lanes' m, l and acc are never written out)
      const int64_t rows = std::min<int64_t>(MB, M - rb * MB);
      const int64_t ru = kPairs<T> ? (rows + kPairRU<NV> - 1) / kPairRU<NV> * kPairRU<NV> : MB;
      const int64_t nvu = kPairs<T> ? pair_vectors<NV>(rows) : MB / kW;  // every P@V row tile's probabilities
      if (causal && kofs >= lim(rb * MB + rows - 1)) continue;  // no row of the block sees this chunk
      if constexpr (kPairs<T>)
        scores_rows<MB, kPairKU<NV>>(rows, qp + rb * d / 2 * MB, reinterpret_cast<const uint16_t*>(kbase + ch * a.cs),
                                      nt, d, a.qscale, st, rmax);
      else
        scores<NV>(qt + rb * d * MB, kc, nt, d, st, rmax, pf);
      const bool masked = causal && kofs + nt > lim(rb * MB);  // some row of the block sees only part of the chunk
      if (masked) mask_scores(st, rmax, nt, rows, nvu * kW, MB, [&](int64_t x) { return lim(rb * MB + x) - kofs; });
      float* mr = m + rb * MB;
      float* lr = l + rb * MB;
      float* ar = acc + rb * MB * d;
      alignas(64) float alpha[MB];
      for (int v = 0; v < nvu; ++v) {
        const int64_t o = v * kW;
        const vf mx = cs::load(rmax + o);
        const vf mo = cs::load(mr + o), mn = cs::vmax(mo, mx);
        vf sum{};
        if constexpr (kPairs<T>) {
          // masked keys: exp16 gives 2^-144 or so, which the bf16 conversion (DAZ) makes exactly 0
          sum = exp_pairs<MB>(st, nt, o, mn, w.pp.data(), pf);
        } else {
          for (int64_t t = 0; t < nt; ++t) {
            const vf e = cs::vexp(cs::load(st + t * MB + o) - mn);
            cs::store(st + t * MB + o, e);
            sum += e;
          }
        }
        const vf al = cs::vexp(mo - mn);  // 0 where m was -inf
        cs::store(lr + o, cs::load(lr + o) * al + sum);
        cs::store(mr + o, mn);
        cs::store(alpha + o, al);
      }
      for (int64_t x = 0; x < ru; ++x) {
        if (alpha[x] == 1.f) continue;
        float* ox = ar + x * d;
        const vf av = cs::splat(alpha[x]);
        for (int64_t jd = 0; jd < d; jd += kW) cs::store(ox + jd, cs::load(ox + jd) * av);
      }
      if constexpr (kPairs<T>) {
        pv_pairs<MB, kPairRU<NV>>(w.pp.data(), w.vp.data(), (nt + 1) / 2, d, ar, ru);
      } else {
        pv<NV>(st, vc, nt, d, ar);
      }
    }
  }
  finish_item(a, r, h, s, acc, m, l);
}

template <typename T, int NV>
void run(const RunArgs& a, int nthreads) {
  constexpr int64_t MB = Tile<NV>::MB;
  const int64_t items = a.R * a.hkv * a.nsplit;
  const int64_t mp = (a.mmax + MB - 1) / MB * MB;
#pragma omp parallel num_threads(nthreads)
  {
    static thread_local Scratch w;  // kept by each pool thread: no page faults for fresh buffers on every call
    grow(w.qt, mp * a.d);
    grow(w.acc, mp * a.d);
    grow(w.m, mp), grow(w.l, mp), grow(w.st, a.c * MB);
    if constexpr (kPairs<T>) {
      grow(w.pp, (a.c + 1) / 2 * MB);
      grow(w.vp, (a.c + 1) / 2 * a.d);
#ifdef CS_RUN_AMX
      if (cs_amx::usable(a.d)) {  // segment buffers (run_amx.h)
        const int64_t m16 = (a.mmax + 15) / 16 * 16;
        grow(w.qb, m16 * a.d);
        grow(w.kt, cs_amx::kSegBlocks * a.d / 2 * cs_amx::kKeys);
        grow(w.vp, cs_amx::kSegBlocks * 32 * a.d);
        grow(w.pb, 32 * cs_amx::kLdP);
        grow(w.st, 32 * cs_amx::kLd), grow(w.qt, 32 * a.d);
        grow(w.acc, m16 * a.d);
        grow(w.m, m16), grow(w.l, m16), grow(w.lim, m16);
      }
#endif
    } else if constexpr (!std::is_same_v<T, float>) {
      grow(w.kf, a.c * a.d);
      grow(w.vf_, a.c * a.d);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it)
      run_item<T, NV>(a, it / (a.hkv * a.nsplit), (it / a.nsplit) % a.hkv, it % a.nsplit, w);
    if (a.nsplit > 1) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t rh = 0; rh < a.R * a.hkv; ++rh) merge(a, rh / a.hkv, rh % a.hkv, w.acc.data());
    }
  }
}

}  // namespace

extern "C" {

int cs_vector_width() { return kW; }

// 1 where bf16 runs of head dim d take the AMX tile path (compiled in, granted by the OS, d a multiple of 64).
int cs_run_amx(int64_t d) {
#ifdef CS_RUN_AMX
  return cs_amx::usable(d) ? 1 : 0;
#else
  (void)d;
  return 0;
#endif
}

// 1 where bf16 runs multiply bf16 pairs with vdpbf16ps (compiled in: AVX512-BF16).
int cs_run_bf16_pairs() { return kPairs<cs::Bf16> ? 1 : 0; }

// dtype: 0 fp32, 1 bf16, 2 fp16; flags: kOneSlot (1) writes every run into slot 0, kAccumulate (2, with
// kOneSlot) merges into the (o, lse) there; q arrives multiplied by qscale (> 0), or unscaled with kRawQ (4); q is bf16
// with kQBf16 (8), o is bf16 with kOutBf16 (16, not with kAccumulate). Returns 0, or a negative code for unsupported
// arguments (cpu_kernel.py's RUN_ERRORS says what each means).
int cs_run_attention(const void* q, const void* k, const void* v, int64_t hs, int64_t cs, int dtype,
                     const int32_t* rows, const int32_t* cptr, const int32_t* chunks, const int32_t* tokens,
                     int64_t R, int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t c, int64_t nsplit,
                     int64_t mmax, float* so, float* slse, void* o, float* lse, int nthreads, int64_t flags,
                     float qscale, const int32_t* qpos) {
  if (d < 1 || d % kW != 0 || c < 1 || nsplit < 1 || g < 1 || !(qscale > 0.f)) return -1;
  if (qpos != nullptr && nsplit > 1) return -5;  // causal runs keep their chunks in one item
  if ((flags & kAccumulate) && !(flags & kOneSlot)) return -4;
  if (nsplit > 1 && (so == nullptr || slse == nullptr)) return -2;
  if (((flags & kOutBf16) && (flags & kAccumulate)) || ((flags & kQBf16) && d > kQBufMax)) return -6;
  const RunArgs a{q, k, v, hs, cs, rows, cptr, chunks, tokens, R, b, hkv, g, d, c, nsplit, mmax, so, slse, o, lse,
                  flags, qpos, qscale};
  if (nthreads < 1) nthreads = 1;
  // row blocks of 3 vectors (the better tile) unless 2 pad the runs' rows less
  int64_t pad2 = 0, pad3 = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t M = (rows[2 * r + 1] - rows[2 * r]) * g;
    pad2 += (M + 2 * kW - 1) / (2 * kW) * (2 * kW) - M;
    pad3 += (M + 3 * kW - 1) / (3 * kW) * (3 * kW) - M;
  }
  const bool three = pad3 <= pad2;
  switch (dtype) {
    case 0: three ? run<float, 3>(a, nthreads) : run<float, 2>(a, nthreads); return 0;
    case 1: three ? run<cs::Bf16, 3>(a, nthreads) : run<cs::Bf16, 2>(a, nthreads); return 0;
    case 2: three ? run<_Float16, 3>(a, nthreads) : run<_Float16, 2>(a, nthreads); return 0;
    default: return -3;
  }
}

}  // extern "C"
