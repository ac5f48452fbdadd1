// The narrow Q4_1 / Q8_0 tiles of qmatmul.cpp: one group of 8 output rows x MT (<= 4) activation rows in 256-bit
// vectors (AVX2, with VNNI where the CPU has it), or the scalar forms of qscalar.h. Included inside qmatmul.cpp's
// anonymous namespace (it uses kQ4Bytes, kQ8Bytes, kGroup and kBlock from there). Calls of many rows take the
// wide tiles of qwide.h instead (with AVX512-VNNI), which compute the same bits.
#pragma once

// With AVX512-VNNI (and VL), one `vpdpbusd` (unsigned bytes x signed bytes, 4 products into each int32 lane)
// replaces vpmaddubsw + vpaddw (+ vpmaddwd). The block sums are exact integers either way, so the outputs are
// bitwise the same; int4 steps of 4 rows a tile run ~1.2x faster, one row about the same (memory-bound there).
// (A 512-bit form over two row groups was tried: no faster in cache, 2x slower on weights beyond L3 on Zen 4.)
// Q8_0 with VNNI multiplies the offset weights (q + 128) as they are stored and takes 128 * sum(x) off the block
// sum (the activation quantiser's exact integer block sum), instead of two vpsignb a product to make the weight
// operand unsigned; without VNNI an xor restores q for vpmaddubsw's sign trick (whose int16 pairs must not
// saturate, as (q + 128) * x could).
#if CS_Q_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CS_Q_VNNI 1
#else
#define CS_Q_VNNI 0
#endif

#if CS_Q_AVX2
constexpr int64_t kPrefetch = 4096;  // bytes ahead of the block being read

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 rows of one group x MT activation rows; out[m * ldo + r].
template <int MT>
void group_q4(const uint8_t* pw, int64_t nb, const int8_t* xq, int64_t K, const float* xa, const float* xs,
              float* out, int64_t ldo) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pw += kQ4Bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(pw) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pw) + kPrefetch + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pw) + kPrefetch + 128, _MM_HINT_T0);
    __m256i p16[MT], q32[MT];  // VNNI: int32 sums of the low (p16) and high (q32) nibbles, two chains
    for (int m = 0; m < MT; ++m) p16[m] = q32[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 32 * i));
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      for (int m = 0; m < MT; ++m) {  // int16 sums stay within 8 * 2 * 15 * 127: no saturation
        const int8_t* xb = xq + m * K + b * kBlock + 4 * i;
#if CS_Q_VNNI
        p16[m] = _mm256_dpbusd_epi32(p16[m], lo, bcast4(xb));
        q32[m] = _mm256_dpbusd_epi32(q32[m], hi, bcast4(xb + 16));
#else
        p16[m] = _mm256_add_epi16(p16[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb)),
                                                           _mm256_maddubs_epi16(hi, bcast4(xb + 16))));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 128)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 144)));
    for (int m = 0; m < MT; ++m) {
#if CS_Q_VNNI
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(p16[m], q32[m]));
#else
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16[m], ones));
#endif
      acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xa[m * nb + b])), acc[m]);
      acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[m * nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

template <int MT>
void group_q8(const uint8_t* pw, int64_t nb, const int8_t* xq, int64_t K, const float* xa, const float* xsum,
              float* out, int64_t ldo) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, pw += kQ8Bytes) {
    for (int64_t c = 0; c < kQ8Bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(pw) + kPrefetch + c, _MM_HINT_T0);
    __m256i p32[MT];
#if CS_Q_VNNI  // sum((q + 128) x) - 128 sum(x), exact in int32
    for (int m = 0; m < MT; ++m) p32[m] = _mm256_set1_epi32(-128 * static_cast<int32_t>(xsum[m * nb + b]));
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 32 * i));
      for (int m = 0; m < MT; ++m) p32[m] = _mm256_dpbusd_epi32(p32[m], w, bcast4(xq + m * K + b * kBlock + 4 * i));
    }
#else
    const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int m = 0; m < MT; ++m) p32[m] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 32 * i)), off);
      const __m256i aw = _mm256_sign_epi8(w, w);  // |q|: vpmaddubsw needs an unsigned operand
      for (int m = 0; m < MT; ++m) {  // one pair sum is at most 2 * 127 * 127: widen before adding
        const __m256i xv = _mm256_sign_epi8(bcast4(xq + m * K + b * kBlock + 4 * i), w);
        p32[m] = _mm256_add_epi32(p32[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
      }
    }
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 256)));
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32[m]), _mm256_mul_ps(d, _mm256_set1_ps(xa[m * nb + b])), acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}
#else
#include "qscalar.h"  // the same integer sums and fused multiply-adds in a scalar loop
#endif
