// Activations for the block-quantised linears (qmatmul.cpp): element conversions, the optional prologue
// (SwiGLU, RMSNorm) and the per-block int8 quantisation of a row (Q8_1). Vectorised on AVX2; the scalar
// fallback computes the same quantities. In bf16 (dtype 1) the prologue rounds where ATen (and glue.cpp) round:
// silu before the multiply by up, the normalised value before the multiply by the norm weight, each product.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CS_Q_AVX2 1
#else
#define CS_Q_AVX2 0
#endif

namespace csq {

constexpr int64_t kBlock = 32;

// Rows of the next tile with `left` rows still to do: the fewest tiles of at most `most` rows, as even as they go
// (20 rows, at most 16: 10 + 10). The bf16 tiles (b16.h) and the wide Q8_0 / Q4_1 tiles (qwide.h) split by it.
constexpr int tile_rows(int64_t left, int64_t most) {
  return static_cast<int>((left + (left + most - 1) / most - 1) / ((left + most - 1) / most));
}

inline float fp16_to_f(uint16_t h) {
#if CS_Q_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      float f = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf16_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float round_to(int dtype, float v) { return dtype == 0 ? v : bf16_to_f(f_to_bf16(v)); }

inline float load_x(const void* x, int dtype, int64_t i) {
  return dtype == 0 ? static_cast<const float*>(x)[i] : bf16_to_f(static_cast<const uint16_t*>(x)[i]);
}

#if CS_Q_AVX2
// exp(x) for x <= 0 (inputs below -87 flush to 0), relative error about 2e-7: x = n ln2 + r, exp(r) by a
// degree-6 polynomial, 2^n through the exponent bits (as kernels/csrc/simd.h).
inline __m256 vexp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fl = _mm256_floor_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
  const __m256 r = _mm256_fnmadd_ps(fl, _mm256_set1_ps(-2.12194440e-4f),
                                    _mm256_fnmadd_ps(fl, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline __m256 round8(int dtype, __m256 v) {  // to bf16 and back, round to nearest even (finite values)
  if (dtype == 0) return v;
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN stays NaN (as f_to_bf16)
}

inline __m256 load8(const void* x, int dtype, int64_t i) {
  if (dtype == 0) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g): exp of -|g| either way.
inline __m256 vsilu(__m256 g) {
  const __m256 e = vexp_neg(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);  // negative lanes: g e^g
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

#if CS_Q_AVX2 && defined(__AVX512F__)
#define CS_Q_AVX512 1
// The same arithmetic as the 8-lane helpers above, 16 lanes at a time (AVX512F only).
inline __m512 vexp_neg16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 dead = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 fl = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fl, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(fl, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fl), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~dead), p, _mm512_castsi512_ps(e));
}

inline __m512 round16(int dtype, __m512 v) {
  if (dtype == 0) return v;
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __m512 r = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, v);
}

inline __m512 load16(const void* x, int dtype, int64_t i) {
  if (dtype == 0) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 vsilu16(__m512 g) {
  const __m512i gi = _mm512_castps_si512(g);
  const __m512 e = vexp_neg16(_mm512_castsi512_ps(_mm512_or_si512(gi, _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmplt_epi32_mask(gi, _mm512_setzero_si512()), g, e);  // sign set: g e^g
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#else
#define CS_Q_AVX512 0
#endif

#if CS_Q_AVX2
// One vector width's helpers for `prologue_row`: 8 lanes (AVX2) or 16 (AVX-512), the same arithmetic per lane.
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kN = 8;
  static V load(const void* x, int dtype, int64_t i) { return load8(x, dtype, i); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V splat(float a) { return _mm256_set1_ps(a); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V round(int dtype, V v) { return round8(dtype, v); }
  static V silu(V v) { return vsilu(v); }
  static __m256 sumsq(__m256 ss, V v) { return _mm256_fmadd_ps(v, v, ss); }
};
#if CS_Q_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kN = 16;
  static V load(const void* x, int dtype, int64_t i) { return load16(x, dtype, i); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V splat(float a) { return _mm512_set1_ps(a); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V round(int dtype, V v) { return round16(dtype, v); }
  static V silu(V v) { return vsilu16(v); }
  static __m256 sumsq(__m256 ss, V v) {  // in 8 lanes, in the 8-lane loop's order: the same sum
    const __m256 lo = _mm512_castps512_ps256(v);
    return _mm256_fmadd_ps(hi8(v), hi8(v), _mm256_fmadd_ps(lo, lo, ss));
  }
};
#endif

// load_row's prologue in vectors of L (K % L::kN == 0).
template <class L>
inline void prologue_row(const void* x, int dtype, int64_t K, bool glu, const void* norm_w, float eps, float* f) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t j = 0; j < K; j += L::kN) {
    typename L::V v = L::load(x, dtype, j);
    if (glu) v = L::round(dtype, L::mul(L::round(dtype, L::silu(v)), L::load(x, dtype, K + j)));
    ss = L::sumsq(ss, v);
    L::store(f + j, v);
  }
  if (norm_w == nullptr) return;
  const typename L::V inv = L::splat(1.0f / std::sqrt(hsum8(ss) / static_cast<float>(K) + eps));
  for (int64_t j = 0; j < K; j += L::kN)
    L::store(f + j, L::round(dtype, L::mul(L::round(dtype, L::mul(L::loadf(f + j), inv)), L::load(norm_w, dtype, j))));
}
#endif

// The row's K inputs in fp32, after the optional prologue: SwiGLU (glu: the row holds 2K values, gate then up;
// f = silu(gate) * up) and RMSNorm (norm_w: f = f / sqrt(mean(f^2) + eps) * norm_w, statistics in fp32).
inline void load_row(const void* x, int dtype, int64_t K, bool glu, const void* norm_w, float eps, float* f) {
  int64_t j = 0;
#if CS_Q_AVX512
  if (K % 16 == 0) return prologue_row<Lanes16>(x, dtype, K, glu, norm_w, eps, f);  // always: K % 32 == 0
#endif
#if CS_Q_AVX2
  if (K % 8 == 0) return prologue_row<Lanes8>(x, dtype, K, glu, norm_w, eps, f);
#endif
  for (; j < K; ++j) f[j] = load_x(x, dtype, j);
  if (glu) {
    for (j = 0; j < K; ++j) f[j] = round_to(dtype, round_to(dtype, f[j] / (1.0f + std::exp(-f[j]))) * load_x(x, dtype, K + j));
  }
  if (norm_w != nullptr) {
    float ss = 0.0f;
    for (j = 0; j < K; ++j) ss += f[j] * f[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    for (j = 0; j < K; ++j) f[j] = round_to(dtype, round_to(dtype, f[j] * inv) * load_x(norm_w, dtype, j));
  }
}

// One row of K fp32 values -> K int8 (plain order), K/32 scales a and K/32 sums s = a * sum(q) (int_sums: the
// integer sum(q) itself, exact in a float: |sum| <= 32 * 127).
inline void quantize_row(const float* f, int64_t K, int8_t* q, float* a, float* s, bool int_sums = false) {
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const float* buf = f + b * kBlock;
#if CS_Q_AVX512
    const __m512 v0 = _mm512_loadu_ps(buf), v1 = _mm512_loadu_ps(buf + 16);
    // amax in the 8-lane code's order (vmaxps keeps its second operand when one is NaN)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_max_ps(_mm256_setzero_ps(), _mm256_and_ps(_mm512_castps512_ps256(v0), absmask));
    mx = _mm256_max_ps(mx, _mm256_and_ps(hi8(v0), absmask));
    mx = _mm256_max_ps(mx, _mm256_and_ps(_mm512_castps512_ps256(v1), absmask));
    mx = _mm256_max_ps(mx, _mm256_and_ps(hi8(v1), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // round half to even
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(i0));  // saturating, as packs
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(i1));
    a[b] = d;
    s[b] = (int_sums ? 1.0f : d) * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
#elif CS_Q_AVX2
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(buf + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i iv[4];  // round half to even, as nearbyint in the default rounding mode
    for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const __m256i p16 = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p8);
    a[b] = d;
    s[b] = (int_sums ? 1.0f : d) * static_cast<float>(_mm_cvtsi128_si32(s4));
#else
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(buf[j]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(buf[j] * inv));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    a[b] = d;
    s[b] = (int_sums ? 1.0f : d) * static_cast<float>(sum);
#endif
  }
}

// In-place RoPE of the first `cols` values of row y[off:] (heads of d values): v = v * c + swap_halves(v) * s.
inline void rope_row(void* y, int ydtype, int64_t off, const void* c, const void* s, int64_t cols, int64_t d) {
  float v[1024];
  const int64_t half = d / 2;
  for (int64_t h0 = 0; h0 < cols; h0 += d) {
    for (int64_t j = 0; j < d; ++j) v[j] = load_x(y, ydtype, off + h0 + j);
    for (int64_t j = 0; j < d; ++j) {
      // rounded as ATen (and glue.cpp) in bf16: round(round(swap_halves(v) * s) + v * c)
      const float r = v[j] * load_x(c, ydtype, j) + round_to(ydtype, v[j < half ? j + half : j - half] * load_x(s, ydtype, j));
      if (ydtype == 0) {
        static_cast<float*>(y)[off + h0 + j] = r;
      } else {
        static_cast<uint16_t*>(y)[off + h0 + j] = f_to_bf16(r);
      }
    }
  }
}

}  // namespace csq
