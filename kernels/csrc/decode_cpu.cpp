// chunkserve CPU decode attention over the chunk pool, read in place (no gather, no copy).
//
// Each batch row attends, for every KV head, over a list of chunks given as a dense table
// [b, P] of chunk ids with the number of valid tokens in each (0 = padding, skipped). Keys and
// values are read where they lie in the pool layer [Hkv, N, c, D]; only valid token slots are
// read, so whatever sits in free slots (even NaN) never reaches the result.
//
// Work items are (row, kv head, split): a split is a range of `cps` chunk positions, so that a
// small batch with long rows still keeps every thread busy (flash-decoding). Each item runs a
// blocked online softmax: the scores of one chunk for the g query heads of the KV head, their
// max, one rescale of the accumulator, then P@V. Splits of a row are merged by log-sum-exp.
// Output: fp32 o [b, Hkv, g, D] (normalised) and lse [b, Hkv, g] (-inf for a row with no keys).
//
// Plain C ABI (called through ctypes, which releases the GIL); no torch headers, so it builds in
// about a second. OpenMP threads come from the runtime torch already loaded (same soname).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <omp.h>

#include "decode_tiles.h"
#include "simd.h"

namespace {

using cs::Bf16;
using cs::to_f;

constexpr int64_t kMaxG = 32;     // query heads per KV head
constexpr int64_t kMaxC = 256;    // chunk size
static_assert(kMaxC == cs_tile::kRowStride, "the tiles address scores by this stride");
constexpr int64_t kMaxD = 256;    // head dim
constexpr int64_t kMaxSlots = 64;  // partials merged per row by a fused TPP layer (shared runs + 1)


struct Args {
  const float* q;            // [b, hkv, g, d] fp32, pre-scaled by the softmax scale
  const void* k;             // pool layer, element (h, n, t, j) at h*hs + n*cs + t*d + j
  const void* v;
  int64_t hs, cs;            // head and chunk strides (elements)
  const int32_t* table;      // [b, P]
  const int32_t* tokens;     // [b, P]
  int64_t b, hkv, g, d, c, P;
  int64_t cps, nsplit;       // chunk positions per split, splits per row
  float* so;                 // [b, hkv, nsplit, g, d] scratch (nsplit > 1)
  float* slse;               // [b, hkv, nsplit, g]
  float* o;                  // [b, hkv, g, d]
  float* lse;                // [b, hkv, g] or null
};

template <typename T>
void run_item(const Args& a, int64_t row, int64_t h, int64_t s, float* o_dst, float* lse_dst) {
  const int64_t g = a.g, d = a.d;
  const float* q = a.q + (row * a.hkv + h) * g * d;
  const T* kbase = static_cast<const T*>(a.k) + h * a.hs;
  const T* vbase = static_cast<const T*>(a.v) + h * a.hs;
  alignas(64) float acc[kMaxG * kMaxD];
  alignas(64) float sc[kMaxG * kMaxC];
  float m[kMaxG], l[kMaxG];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t gi = 0; gi < g; ++gi) { m[gi] = ninf; l[gi] = 0.f; }
  std::memset(acc, 0, sizeof(float) * g * d);
  const int64_t p0 = s * a.cps, p1 = std::min(a.P, p0 + a.cps);
  const int32_t* tab = a.table + row * a.P;
  const int32_t* tok = a.tokens + row * a.P;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t nt = tok[p];
    if (nt <= 0) continue;
    const T* kc = kbase + static_cast<int64_t>(tab[p]) * a.cs;
    const T* vc = vbase + static_cast<int64_t>(tab[p]) * a.cs;
    if (p + 1 < p1 && tok[p + 1] > 0) {  // the next chunk lies anywhere in the pool: fetch it while this one runs
      const int64_t nx = static_cast<int64_t>(tab[p + 1]) * a.cs;
      cs::prefetch_kv<2>(kbase + nx, vbase + nx, tok[p + 1] * d);
    }
    cs_tile::by_groups(g, [&](int64_t g0, auto gb) {  // scores: sc[gi, t] = q_gi . k_t
      cs_tile::scores<T, decltype(gb)::value>(q + g0 * d, kc, nt, d, sc + g0 * kMaxC);
    });
    for (int64_t gi = 0; gi < g; ++gi) {  // online softmax, one rescale per chunk
      float* sg = sc + gi * kMaxC;
      float bm = sg[0];
      for (int64_t t = 1; t < nt; ++t) bm = sg[t] > bm ? sg[t] : bm;
      const float nm = bm > m[gi] ? bm : m[gi];
      if (nm > m[gi] && l[gi] > 0.f) {
        const float alpha = std::exp(m[gi] - nm);
        l[gi] *= alpha;
        float* ag = acc + gi * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) ag[j] *= alpha;
      }
      m[gi] = nm;
      cs::vf vsum{};
      int64_t t = 0;
      for (; t + cs::kW <= nt; t += cs::kW) {  // vectorised exp, kW scores at a time
        const cs::vf e = cs::vexp(cs::load(sg + t) - nm);
        cs::store(sg + t, e);
        vsum += e;
      }
      float sum = 0.f;
      for (int w = 0; w < cs::kW; ++w) sum += vsum[w];
      for (; t < nt; ++t) {
        const float e = std::exp(sg[t] - nm);
        sg[t] = e;
        sum += e;
      }
      l[gi] += sum;
    }
    cs_tile::by_groups(g, [&](int64_t g0, auto gb) {  // acc[gi] += p[gi, t] * v_t
      cs_tile::pv<T, decltype(gb)::value>(sc + g0 * kMaxC, vc, nt, d, acc + g0 * d);
    });
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    float* od = o_dst + gi * d;
    if (l[gi] > 0.f) {
      const float inv = 1.f / l[gi];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) od[j] = acc[gi * d + j] * inv;
      if (lse_dst) lse_dst[gi] = m[gi] + std::log(l[gi]);
    } else {
      std::memset(od, 0, sizeof(float) * d);
      if (lse_dst) lse_dst[gi] = ninf;
    }
  }
}

// Merge the splits of (row, h) by log-sum-exp into o / lse.
void merge_splits(const Args& a, int64_t row, int64_t h) {
  const int64_t g = a.g, d = a.d, S = a.nsplit;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t base = (row * a.hkv + h) * S;
  for (int64_t gi = 0; gi < g; ++gi) {
    float mx = ninf;
    for (int64_t s = 0; s < S; ++s) mx = a.slse[(base + s) * g + gi] > mx ? a.slse[(base + s) * g + gi] : mx;
    float* od = a.o + ((row * a.hkv + h) * g + gi) * d;
    std::memset(od, 0, sizeof(float) * d);
    if (mx == ninf) {
      if (a.lse) a.lse[(row * a.hkv + h) * g + gi] = ninf;
      continue;
    }
    float tot = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const float ls = a.slse[(base + s) * g + gi];
      if (ls == ninf) continue;
      const float w = std::exp(ls - mx);
      tot += w;
      const float* src = a.so + ((base + s) * g + gi) * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) od[j] += w * src[j];
    }
    const float inv = 1.f / tot;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) od[j] *= inv;
    if (a.lse) a.lse[(row * a.hkv + h) * g + gi] = mx + std::log(tot);
  }
}

template <typename T>
void run(const Args& a, int nthreads) {
  const int64_t items = a.b * a.hkv * a.nsplit;
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t s = it % a.nsplit, rh = it / a.nsplit;
      const int64_t h = rh % a.hkv, row = rh / a.hkv;
      if (a.nsplit == 1) {
        run_item<T>(a, row, h, 0, a.o + rh * a.g * a.d, a.lse ? a.lse + rh * a.g : nullptr);
      } else {
        run_item<T>(a, row, h, s, a.so + it * a.g * a.d, a.slse + it * a.g);
      }
    }
    if (a.nsplit > 1) {
#pragma omp for schedule(static)
      for (int64_t rh = 0; rh < a.b * a.hkv; ++rh) merge_splits(a, rh / a.hkv, rh % a.hkv);
    }
  }
}


// --- one fused decode layer: K/V writes, scaled q, attention (TPP: runs, private pass, merge), output ---

inline float load_act(const void* p, int64_t dtype, int64_t i) {
  return dtype == 0 ? static_cast<const float*>(p)[i] : to_f(static_cast<const Bf16*>(p)[i]);
}

// d values from an activation row (dtype 0 fp32, 1 bf16) into a pool row (0 fp32, 1 bf16, 2 fp16).
void put_row(const void* src, int64_t sdtype, int64_t soff, void* dst, int64_t ddtype, int64_t doff, int64_t d) {
  if (sdtype == ddtype) {
    const size_t size = sdtype == 0 ? 4 : 2;
    std::memcpy(static_cast<char*>(dst) + doff * size, static_cast<const char*>(src) + soff * size, d * size);
    return;
  }
  for (int64_t j = 0; j < d; ++j) {
    const float x = load_act(src, sdtype, soff + j);
    if (ddtype == 0) {
      static_cast<float*>(dst)[doff + j] = x;
    } else if (ddtype == 1) {
      static_cast<uint16_t*>(dst)[doff + j] = cs::bf16_bits(x);
    } else {
      static_cast<_Float16*>(dst)[doff + j] = static_cast<_Float16>(x);
    }
  }
}

// out[x] = sum over slots of o_s[x] * w_s / sum w_s, w_s = exp(lse_s - max lse) (combine_partials' formula);
// absent partials (lse -inf) are skipped, so whatever their o slot holds never reaches the result.
void merge_slots(const float* po, const float* plse, int64_t S, int64_t slot, int64_t d, float* out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < slot; ++x) {
    float m = ninf;
    for (int64_t s = 0; s < S; ++s) m = plse[s * slot + x] > m ? plse[s * slot + x] : m;
    float w[kMaxSlots];
    float tot = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      w[s] = plse[s * slot + x] == ninf ? 0.f : std::exp(plse[s * slot + x] - m);
      tot += w[s];
    }
    float* od = out + x * d;
    for (int64_t j = 0; j < d; ++j) od[j] = 0.f;
    if (tot <= 0.f) continue;  // no keys at all (cannot happen for a decode row: it sees its own key)
    for (int64_t s = 0; s < S; ++s) {
      if (w[s] == 0.f) continue;
      const float ws = w[s] / tot;
      const float* os = po + (s * slot + x) * d;
      for (int64_t j = 0; j < d; ++j) od[j] += os[j] * ws;
    }
  }
}

}  // namespace

extern "C" {

// The per-step constant half of `cs_decode_layer` (every integer field int64, so the ctypes mirror is plain).
struct CsLayerPlan {
  int64_t act_dtype;   // q, k, v rows and out: 0 fp32, 1 bf16
  int64_t pool_dtype;  // 0 fp32, 1 bf16, 2 fp16
  int64_t hs, cs;      // pool head and chunk strides (elements); token stride d
  const int32_t* table;
  const int32_t* tokens;  // [b, P]
  int64_t b, hkv, g, d, c, P, cps, nsplit;
  float* so;
  float* slse;         // split scratch (nsplit > 1)
  float* qbuf;         // [b, hkv, g, d] scratch: q * scale in fp32
  float* obuf;         // [b, hkv, g, d] scratch: fp32 output (act_dtype bf16)
  double scale;
  int64_t nthreads;
  int64_t nwrite;
  const int64_t* slots;       // [nwrite] flat slot (chunk * c + token) of each written row
  const int64_t* write_rows;  // [nwrite] source row of each write, or null (row t)
  // TPP (R > 0 shared runs): phase 1 (`cs_run_attention`) into slots [0, R) of part_o / part_lse, the private
  // pass (the table above) into slot R when has_private, then one log-sum-exp merge per row into the output
  int64_t R;
  const int32_t* run_rows;    // [R, 2]
  const int32_t* run_cptr;    // [R + 1]
  const int32_t* run_chunks;
  const int32_t* run_tokens;
  int64_t run_nsplit, run_mmax, run_threads;
  float* run_so;
  float* run_slse;
  float* part_o;              // [R + 1, b, hkv, g, d]
  float* part_lse;            // [R + 1, b, hkv, g]
  int64_t has_private;
};

int cs_run_attention(const void* q, const void* k, const void* v, int64_t hs, int64_t cs, int dtype,
                     const int32_t* rows, const int32_t* cptr, const int32_t* chunks, const int32_t* tokens,
                     int64_t R, int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t c, int64_t nsplit,
                     int64_t mmax, float* so, float* slse, void* o, float* lse, int nthreads, int64_t flags,
                     float qscale, const int32_t* qpos);

// q: [b, hkv*g, d] rows of stride ldq; k, v: [>= rows, hkv, d] rows of stride ldk / ldv (head stride d);
// pools [hkv, N, c, d]; out: [b, hkv*g, d] contiguous in act_dtype. Writes first, so a row sees its own key.
int cs_decode_layer(const CsLayerPlan* p, const void* q, int64_t ldq, const void* k, int64_t ldk, const void* v,
                    int64_t ldv, void* kpool, void* vpool, void* out) {
  if (p->g < 1 || p->g > kMaxG || p->c < 1 || p->c > kMaxC || p->d < 1 || p->d > kMaxD || p->cps < 1 ||
      p->nsplit < 1 || p->act_dtype < 0 || p->act_dtype > 1 || p->pool_dtype < 0 || p->pool_dtype > 2 ||
      p->cs != p->c * p->d)
    return -1;
  if (p->nsplit > 1 && (p->so == nullptr || p->slse == nullptr)) return -2;
  if (p->R < 0 || p->R + 1 > kMaxSlots) return -4;
  const int64_t hkv = p->hkv, g = p->g, d = p->d;
  for (int64_t t = 0; t < p->nwrite; ++t) {
    const int64_t row = p->write_rows != nullptr ? p->write_rows[t] : t;
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t dst = h * p->hs + p->slots[t] * d;
      put_row(k, p->act_dtype, row * ldk + h * d, kpool, p->pool_dtype, dst, d);
      put_row(v, p->act_dtype, row * ldv + h * d, vpool, p->pool_dtype, dst, d);
    }
  }
  const float scale = static_cast<float>(p->scale);
  for (int64_t r = 0; r < p->b; ++r)
    for (int64_t j = 0; j < hkv * g * d; ++j) p->qbuf[r * hkv * g * d + j] = load_act(q, p->act_dtype, r * ldq + j) * scale;
  float* o = p->act_dtype == 0 ? static_cast<float*>(out) : p->obuf;
  const int64_t slot = p->b * hkv * g;  // rows x heads of one partial slot
  const bool tpp = p->R > 0;
  if (tpp) {
    if (p->part_o == nullptr || p->part_lse == nullptr || p->run_rows == nullptr) return -3;
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < p->R * slot; ++i) p->part_lse[i] = ninf;  // rows outside a run: absent
    const int rc = cs_run_attention(p->qbuf, kpool, vpool, p->hs, p->cs, static_cast<int>(p->pool_dtype),
                                    p->run_rows, p->run_cptr, p->run_chunks, p->run_tokens, p->R, p->b, hkv, g, d,
                                    p->c, p->run_nsplit, p->run_mmax, p->run_so, p->run_slse, p->part_o,
                                    p->part_lse, static_cast<int>(p->run_threads < 1 ? 1 : p->run_threads), 0, scale,
                                    nullptr);
    if (rc != 0) return rc - 10;
  }
  if (!tpp || p->has_private) {
    float* po = tpp ? p->part_o + p->R * slot * d : o;
    const Args a{p->qbuf, kpool, vpool, p->hs, p->cs, p->table, p->tokens, p->b, hkv, g, d, p->c, p->P, p->cps,
                 p->nsplit, p->so, p->slse, po, tpp ? p->part_lse + p->R * slot : nullptr};
    const int nthreads = p->nthreads < 1 ? 1 : static_cast<int>(p->nthreads);
    switch (p->pool_dtype) {
      case 0: run<float>(a, nthreads); break;
      case 1: run<Bf16>(a, nthreads); break;
      default: run<_Float16>(a, nthreads); break;
    }
  }
  if (tpp) merge_slots(p->part_o, p->part_lse, p->R + (p->has_private ? 1 : 0), slot, d, o);
  if (p->act_dtype == 1) {
    uint16_t* ob = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < p->b * hkv * g * d; ++i) ob[i] = cs::bf16_bits(o[i]);
  }
  return 0;
}

int cs_abi_version() { return 8; }

// dtype: 0 fp32, 1 bf16, 2 fp16. Returns 0, or a negative code for unsupported shapes.
int cs_decode_attention(const float* q, const void* k, const void* v, int64_t hs, int64_t cs, int dtype,
                        const int32_t* table, const int32_t* tokens, int64_t b, int64_t hkv, int64_t g,
                        int64_t d, int64_t c, int64_t P, int64_t cps, int64_t nsplit, float* so, float* slse,
                        float* o, float* lse, int nthreads) {
  if (g < 1 || g > kMaxG || c < 1 || c > kMaxC || d < 1 || d > kMaxD || cps < 1 || nsplit < 1) return -1;
  if (nsplit > 1 && (so == nullptr || slse == nullptr)) return -2;
  const Args a{q, k, v, hs, cs, table, tokens, b, hkv, g, d, c, P, cps, nsplit, so, slse, o, lse};
  if (nthreads < 1) nthreads = 1;
  switch (dtype) {
    case 0: run<float>(a, nthreads); return 0;
    case 1: run<Bf16>(a, nthreads); return 0;
    case 2: run<_Float16>(a, nthreads); return 0;
    default: return -3;
  }
}

}  // extern "C"
