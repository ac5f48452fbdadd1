// Portable SIMD helpers for the CPU attention kernels: GCC/Clang vector extensions (no intrinsics),
// so the same source compiles to AVX-512, AVX2, SSE or NEON under -march=native.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cs {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats per vector register
#elif defined(__AVX__) || defined(__ARM_NEON)
constexpr int kW = 8;   // AVX: one ymm; NEON: two q registers (the compiler splits)
#else
constexpr int kW = 4;
#endif

typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));

struct Bf16 { uint16_t bits; };

inline float to_f(float x) { return x; }
inline float to_f(Bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f(_Float16 x) { return static_cast<float>(x); }
// fp32 -> bf16 bits, round to nearest even, NaN stays NaN (torch's .to(bfloat16)); workers/csrc/qact.h has
// the same conversion for the separately built int4 library.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return vf{} + x; }
// Pin a value to a register: stops the compiler from re-loading it as a memory operand of every
// FMA (which makes a register-tiled loop load-bound).
inline void keep(vf& v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Every cache line of a chunk's n elements of K (at k) and V (at v) into the cache level `Locality` names
// (__builtin_prefetch: 3 = L1, 2 = L2): the next chunk of a row or run, fetched while the current one computes.
template <int Locality, typename T>
inline void prefetch_kv(const T* k, const T* v, int64_t n) {
  const char* kc = reinterpret_cast<const char*>(k);
  const char* vc = reinterpret_cast<const char*>(v);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) {
    __builtin_prefetch(kc + off, 0, Locality);
    __builtin_prefetch(vc + off, 0, Locality);
  }
}

// Lines of the next chunk's K and V still to prefetch, one of each every `every` steps of a loop (`step()` once a step;
// lines beyond the loop's steps are left to the hardware): a burst of a whole chunk's prefetches at once left most
// of it unfetched (fp32 GQA at full sharing, K/V cold: 1.55 ms against 1.45 ms spread).
struct Spread {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t left = 0, every = 1, tick = 1;
  void step() {
    if (left > 0 && --tick == 0) {
      __builtin_prefetch(k, 0, 3), __builtin_prefetch(v, 0, 3);
      k += 64, v += 64, --left, tick = every;
    }
  }
};

// exp(x) for x <= 0 (softmax arguments; inputs below -87 flush to 0, -inf gives 0), relative error
// about 2e-7: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n through the exponent bits.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  const vi dead = x < lo;  // lanes that underflow (and -inf): result 0
  x = dead ? lo : x;
  const vf t = x * 1.44269504088896341f;
  vf fl = __builtin_convertvector(__builtin_convertvector(t, vi), vf);  // trunc toward 0
  fl = fl > t ? fl - 1.0f : fl;                                          // floor
  const vf r = x - fl * 0.693359375f - fl * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi e = (__builtin_convertvector(fl, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(vf));
  const vf res = p * scale;
  return dead ? vf{} : res;
}

}  // namespace cs
