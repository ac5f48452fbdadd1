// The glue of a dense (fp32/bf16) decoder layer between its matmuls, one call each instead of a dozen small
// ATen ops: residual add + RMSNorm, RoPE in place, SwiGLU. Between large matmuls each small ATen op costs
// tens of microseconds (its code and data are out of cache); these loops touch each value once.
//
// Rounding follows the ATen ops they replace (workers/model.py's torch loop): an add, a norm's cast before
// its weight multiply, silu before the multiply by up, RoPE's swap * sin before the add of x * cos are each
// rounded to the model dtype where ATen rounds them (in bf16 RoPE and the adds give ATen's values). The norm's sum of
// squares runs in another order and silu uses csq::vexp_neg, not ATen's exp, so those can differ from ATen's
// in the last fp32 bit, which moves a few bf16 values in a thousand by one bf16 step.
//
// dtype codes: 0 fp32, 1 bf16. Rows have a leading dimension (elements); values within a row are contiguous.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "qact.h"

namespace {

using csq::bf16_to_f;
using csq::f_to_bf16;
using csq::load_x;

constexpr int64_t kSerialElements = 1 << 16;  // below this many values a call runs on one thread

using csq::round_to;

inline void store_x(void* y, int dtype, int64_t i, float v) {
  if (dtype == 0) {
    static_cast<float*>(y)[i] = v;
  } else {
    static_cast<uint16_t*>(y)[i] = f_to_bf16(v);
  }
}

#if CS_Q_AVX2
using csq::round8;

inline void store8(void* y, int dtype, int64_t i, __m256 v) {  // v already rounded to dtype when bf16
  if (dtype == 0) {
    _mm256_storeu_ps(static_cast<float*>(y) + i, v);
    return;
  }
  const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + i), p);
}
#endif

inline float silu1(float g) { return g / (1.0f + std::exp(-g)); }

template <class F>
void for_rows(int64_t T, int64_t width, int nthreads, F&& f) {
  if (nthreads <= 1 || T < 2 || T * width < kSerialElements) {
    for (int64_t t = 0; t < T; ++t) f(t);
    return;
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < T; ++t) f(t);
}

// h[t] += r[t] (rounded to dtype; skipped when r is null), then o[t] = round(round(h[t] * inv) * w) with
// inv = 1 / sqrt(mean(h[t]^2) + eps) in fp32.
void add_rms_norm_row(void* h, const void* r, void* o, int dtype, int64_t H, const void* w, float eps) {
  int64_t j = 0;
  float ss = 0.0f;
#if CS_Q_AVX2
  if (H % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (; j < H; j += 8) {
      __m256 v = csq::load8(h, dtype, j);
      if (r != nullptr) {
        v = round8(dtype, _mm256_add_ps(v, csq::load8(r, dtype, j)));
        store8(h, dtype, j, v);
      }
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = csq::hsum8(acc);
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
    for (j = 0; j < H; j += 8) {
      const __m256 y = round8(dtype, _mm256_mul_ps(csq::load8(h, dtype, j), inv));
      store8(o, dtype, j, round8(dtype, _mm256_mul_ps(y, csq::load8(w, dtype, j))));
    }
    return;
  }
#endif
  for (; j < H; ++j) {
    float v = load_x(h, dtype, j);
    if (r != nullptr) {
      v = round_to(dtype, v + load_x(r, dtype, j));
      store_x(h, dtype, j, v);
    }
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (j = 0; j < H; ++j) store_x(o, dtype, j, round_to(dtype, load_x(h, dtype, j) * inv) * load_x(w, dtype, j));
}

// In place on the first `cols` values of a row (heads of d values): x = round(round(swap_halves(x) * s) + x * c),
// with c, s: [d] (s signed: -sin on the first half), as `cat(x2, x1).mul_(sin).addcmul_(x, cos)`.
void rope_row(void* x, int dtype, const void* c, const void* s, int64_t cols, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h0 = 0; h0 < cols; h0 += d) {
    int64_t j = 0;
#if CS_Q_AVX2
    for (; half % 8 == 0 && j < half; j += 8) {
      const __m256 a = csq::load8(x, dtype, h0 + j), b = csq::load8(x, dtype, h0 + half + j);
      const __m256 ta = round8(dtype, _mm256_mul_ps(b, csq::load8(s, dtype, j)));
      const __m256 tb = round8(dtype, _mm256_mul_ps(a, csq::load8(s, dtype, half + j)));
      store8(x, dtype, h0 + j, round8(dtype, _mm256_add_ps(ta, _mm256_mul_ps(a, csq::load8(c, dtype, j)))));
      store8(x, dtype, h0 + half + j,
             round8(dtype, _mm256_add_ps(tb, _mm256_mul_ps(b, csq::load8(c, dtype, half + j)))));
    }
#endif
    for (; j < half; ++j) {
      const float a = load_x(x, dtype, h0 + j), b = load_x(x, dtype, h0 + half + j);
      const float ta = round_to(dtype, b * load_x(s, dtype, j)), tb = round_to(dtype, a * load_x(s, dtype, half + j));
      store_x(x, dtype, h0 + j, ta + a * load_x(c, dtype, j));
      store_x(x, dtype, h0 + half + j, tb + b * load_x(c, dtype, half + j));
    }
  }
}

// o[t, j] = round(round(silu(g[t, j])) * u[t, j]) with g = gu[t, :I], u = gu[t, I:2I].
void silu_mul_row(const void* gu, void* o, int dtype, int64_t I) {
  int64_t j = 0;
#if CS_Q_AVX2
  for (; j + 8 <= I; j += 8) {
    const __m256 sg = round8(dtype, csq::vsilu(csq::load8(gu, dtype, j)));
    store8(o, dtype, j, round8(dtype, _mm256_mul_ps(sg, csq::load8(gu, dtype, I + j))));
  }
#endif
  for (; j < I; ++j) store_x(o, dtype, j, round_to(dtype, silu1(load_x(gu, dtype, j))) * load_x(gu, dtype, I + j));
}

inline int64_t esize(int dtype) { return dtype == 0 ? 4 : 2; }

template <class P>
P* at_row(P* p, int dtype, int64_t t, int64_t ld) {
  using B = std::conditional_t<std::is_const_v<P>, const char, char>;
  return reinterpret_cast<P*>(reinterpret_cast<B*>(p) + t * ld * esize(dtype));
}

}  // namespace

extern "C" {

int cs_g_abi_version() { return 1; }
int cs_g_simd() { return CS_Q_AVX2; }

// h: [T, H] (leading dim ldh), updated in place when r ([T, H], ldr) is not null; o: [T, H] (ldo); w: [H].
int cs_g_add_rms_norm(void* h, const void* r, void* o, int dtype, int64_t T, int64_t H, int64_t ldh, int64_t ldr,
                      int64_t ldo, const void* w, float eps, int nthreads) {
  if ((dtype != 0 && dtype != 1) || T < 0 || H <= 0 || ldh < H || ldo < H || (r != nullptr && ldr < H)) return 1;
  for_rows(T, H, nthreads, [&](int64_t t) {
    add_rms_norm_row(at_row(h, dtype, t, ldh), r == nullptr ? nullptr : at_row(r, dtype, t, ldr),
                     at_row(o, dtype, t, ldo), dtype, H, w, eps);
  });
  return 0;
}

// x: [T, >= cols] (ldx), RoPE'd in place over its first cols values; c, s: [T, d] contiguous.
int cs_g_rope(void* x, const void* c, const void* s, int dtype, int64_t T, int64_t ldx, int64_t cols, int64_t d,
              int nthreads) {
  if ((dtype != 0 && dtype != 1) || T < 0 || d <= 0 || d % 2 || cols % d || ldx < cols) return 1;
  for_rows(T, cols, nthreads, [&](int64_t t) {
    rope_row(at_row(x, dtype, t, ldx), dtype, at_row(c, dtype, t, d), at_row(s, dtype, t, d), cols, d);
  });
  return 0;
}

// gu: [T, 2I] (ldgu), o: [T, I] (ldo).
int cs_g_silu_mul(const void* gu, void* o, int dtype, int64_t T, int64_t I, int64_t ldgu, int64_t ldo, int nthreads) {
  if ((dtype != 0 && dtype != 1) || T < 0 || I <= 0 || ldgu < 2 * I || ldo < I) return 1;
  for_rows(T, 3 * I, nthreads, [&](int64_t t) {
    silu_mul_row(at_row(gu, dtype, t, ldgu), at_row(o, dtype, t, ldo), dtype, I);
  });
  return 0;
}

}  // extern "C"
