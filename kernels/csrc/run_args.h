// The arguments of the CPU phase-1 kernel (run_cpu.cpp) and the writes of its results: a query row read as fp32
// (q in fp32, or bf16 converted as it is read), and each row's normalised partial (o, lse) written or merged into the
// output (fp32, or bf16 rounded to nearest even as torch's .to(bfloat16) does). Included by run_cpu.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace cs_run {

struct RunArgs {
  const void* q;           // [b, hkv, g, d] fp32 (bf16 with kQBf16), pre-scaled (unscaled with kRawQ)
  const void* k;           // pool layer, element (h, n, t, j) at h*hs + n*cs + t*d + j
  const void* v;
  int64_t hs, cs;
  const int32_t* rows;     // [R, 2] (i, j)
  const int32_t* cptr;     // [R + 1] offsets into chunks / tokens
  const int32_t* chunks;   // chunk ids of every run, concatenated
  const int32_t* tokens;   // valid tokens per chunk
  int64_t R, b, hkv, g, d, c, nsplit, mmax;
  float* so;               // [R, hkv, nsplit, mmax, d] scratch (nsplit > 1)
  float* slse;             // [R, hkv, nsplit, mmax]
  void* o;                 // [R, b, hkv, g, d] fp32 (bf16 with kOutBf16)
  float* lse;              // [R, b, hkv, g]
  int64_t flags;           // kOneSlot | kAccumulate | kRawQ | kQBf16 | kOutBf16
  const int32_t* qpos;     // [R] causal runs (AMX tiles, bf16 pairs): key index of each run's first token, else null
  float qscale;            // the scale q was multiplied by (the bf16 pair path packs q / qscale, then scales S)
};

constexpr int64_t kOneSlot = 1;     // every run writes slot 0 (their rows are disjoint)
constexpr int64_t kAccumulate = 2;  // merge into (o, lse) of slot 0 instead of overwriting them
constexpr int64_t kRawQ = 4;        // q arrives unscaled: multiplied by qscale as it is read (the same product)
constexpr int64_t kQBf16 = 8;       // q is bf16: each row converted to fp32 as it is read (exact)
constexpr int64_t kOutBf16 = 16;    // o is bf16 (not with kAccumulate): a bf16 model's output without an fp32 copy
constexpr int64_t kQBufMax = 256;   // head dims a bf16 q may have (a row is converted on the stack; cpu_kernel.py's
                                    // MAX_HEAD_DIM)

inline float qpre(const RunArgs& a) { return (a.flags & kRawQ) ? a.qscale : 1.f; }

inline int64_t oslot(const RunArgs& a, int64_t r) { return (a.flags & kOneSlot) ? 0 : r; }

// Element offset (in q, and in each slot of o) of query row x (0 <= x < M) of head h in run rows [i, j): batch row
// i + x / g, group x % g.
inline int64_t qoff(const RunArgs& a, int64_t i, int64_t h, int64_t x) {
  return (((i + x / a.g) * a.hkv + h) * a.g + x % a.g) * a.d;
}

// That query row as fp32: where it lies, or (kQBf16) converted into buf [d].
inline const float* qrow(const RunArgs& a, int64_t i, int64_t h, int64_t x, float* buf) {
  if (!(a.flags & kQBf16)) return static_cast<const float*>(a.q) + qoff(a, i, h, x);
  const cs::Bf16* src = static_cast<const cs::Bf16*>(a.q) + qoff(a, i, h, x);
  for (int64_t j = 0; j < a.d; ++j) buf[j] = cs::to_f(src[j]);
  return buf;
}

// Write the normalised partial (acc / l, m + log l) of one query row (element `off` of slot r of o), or merge it into
// the row's (o, lse).
inline void put_row(const RunArgs& a, int64_t r, int64_t off, const float* acc, float m, float l) {
  const int64_t d = a.d, base = oslot(a, r) * a.b * a.hkv * a.g;
  float* ld = a.lse + base + off / d;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float lse = l > 0.f ? m + std::log(l) : ninf;
  if (a.flags & kOutBf16) {  // never with kAccumulate (cs_run_attention refuses it)
    uint16_t* od = static_cast<uint16_t*>(a.o) + (base * d + off);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t j = 0; j < d; ++j) od[j] = l > 0.f ? cs::bf16_bits(acc[j] * inv) : 0;
    *ld = lse;
    return;
  }
  float* od = static_cast<float*>(a.o) + (base * d + off);
  if (!(a.flags & kAccumulate)) {
    if (l > 0.f) {
      const float inv = 1.f / l;
      for (int64_t j = 0; j < d; ++j) od[j] = acc[j] * inv;
    } else {
      std::memset(od, 0, sizeof(float) * d);
    }
    *ld = lse;
    return;
  }
  if (lse == ninf) return;  // nothing to add
  const float old = *ld;
  if (old == ninf) {  // the row held nothing (its o may be anything): the run's partial alone
    const float inv = 1.f / l;
    for (int64_t j = 0; j < d; ++j) od[j] = acc[j] * inv;
    *ld = lse;
    return;
  }
  const float mx = std::max(old, lse);
  const float w_old = std::exp(old - mx), w_new = std::exp(lse - mx), tot = w_old + w_new;
  const float a_old = w_old / tot, a_new = w_new / (tot * l);
  for (int64_t j = 0; j < d; ++j) od[j] = od[j] * a_old + acc[j] * a_new;
  *ld = mx + std::log(tot);
}

// Write an item's rows: (acc / l, m + log l) into the output (one split) or its split's scratch slot.
inline void finish_item(const RunArgs& a, int64_t r, int64_t h, int64_t s, const float* acc, const float* m,
                        const float* l) {
  const int64_t d = a.d, i = a.rows[2 * r], M = (a.rows[2 * r + 1] - i) * a.g;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < M; ++x) {
    if (a.nsplit == 1) {
      put_row(a, r, qoff(a, i, h, x), acc + x * d, m[x], l[x]);
      continue;
    }
    const int64_t slot = ((r * a.hkv + h) * a.nsplit + s) * a.mmax + x;
    float* od = a.so + slot * d;
    if (l[x] > 0.f) {
      const float inv = 1.f / l[x];
      for (int64_t j = 0; j < d; ++j) od[j] = acc[x * d + j] * inv;
      a.slse[slot] = m[x] + std::log(l[x]);
    } else {
      std::memset(od, 0, sizeof(float) * d);
      a.slse[slot] = ninf;
    }
  }
}

// The splits of (run r, head h) merged by log-sum-exp into the output; sum: [d] scratch.
inline void merge(const RunArgs& a, int64_t r, int64_t h, float* sum) {
  const int64_t d = a.d, i = a.rows[2 * r], M = (a.rows[2 * r + 1] - i) * a.g, S = a.nsplit;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < M; ++x) {
    float mx = ninf;
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, a.slse[((r * a.hkv + h) * S + s) * a.mmax + x]);
    std::memset(sum, 0, sizeof(float) * d);
    float tot = 0.f;  // sum / tot with lse mx + log(tot): the splits' partial, merged like a split's accumulator
    for (int64_t s = 0; s < S && mx != ninf; ++s) {
      const int64_t slot = ((r * a.hkv + h) * S + s) * a.mmax + x;
      if (a.slse[slot] == ninf) continue;
      const float wgt = std::exp(a.slse[slot] - mx);
      tot += wgt;
      for (int64_t j = 0; j < d; ++j) sum[j] += wgt * a.so[slot * d + j];
    }
    put_row(a, r, qoff(a, i, h, x), sum, mx, tot);
  }
}

}  // namespace cs_run
