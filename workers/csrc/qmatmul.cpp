// Block-quantised linear layers for the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), llama.cpp style.
//
// Weights, in blocks of 32 along K (K % 32 == 0):
//   Q4_1: 16 bytes per block (byte j: element j in the low nibble, element j + 16 in the high one),
//         fp16 scale d and fp16 minimum m per block: w = d * q + m, q in [0, 15].
//   Q8_0: 32 int8 per block and an fp16 scale d per block: w = d * q, q in [-127, 127].
// Activations are quantised per row and per block of 32 to int8 (Q8_1: scale a = amax / 127, q = round(x / a),
// plus s = a * sum(q) for the Q4_1 minimum term), so each block is one integer dot product:
//   Q4_1: sum_k w_k x_k = d * a * sum(q_w q_x) + m * s;   Q8_0: d * a * sum(q_w q_x).
// On AVX2 a block is vpmaddubsw + vpmaddwd + one FMA (32 products); elsewhere a scalar loop computes the
// same integer sums (the results agree to float rounding of the per-block accumulation order).
//
// Threads: one OpenMP team (the runtime torch already loaded); rows of x are quantised first, then the
// output columns are split into contiguous ranges of 8 columns. Every output element is the same sum in
// the same order whatever the batch and the thread count (batch-invariant and deterministic).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CS_Q_AVX2 1
#else
#define CS_Q_AVX2 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileM = 64;  // activation rows per tile (64 x K int8 stays in L2)
constexpr int64_t kColGrain = 8;  // output columns per unit of work
constexpr int64_t kMaxBlocks = 1024;  // K <= 32768 (the per-row scale tile lives on the stack)

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

inline float load_x(const void* x, int dtype, int64_t i) {
  return dtype == 0 ? static_cast<const float*>(x)[i] : bf16_to_f(static_cast<const uint16_t*>(x)[i]);
}

// The row's K inputs in fp32, after the optional prologue: SwiGLU (glu: the row holds 2K values, gate then up;
// f = silu(gate) * up) and RMSNorm (norm_w: f = f / sqrt(mean(f^2) + eps) * norm_w, statistics in fp32).
void load_row(const void* x, int dtype, int64_t K, bool glu, const void* norm_w, float eps, float* f) {
  for (int64_t j = 0; j < K; ++j) f[j] = load_x(x, dtype, j);
  if (glu) {
    for (int64_t j = 0; j < K; ++j) f[j] = f[j] / (1.0f + std::exp(-f[j])) * load_x(x, dtype, K + j);
  }
  if (norm_w != nullptr) {
    float ss = 0.0f;
    for (int64_t j = 0; j < K; ++j) ss += f[j] * f[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    for (int64_t j = 0; j < K; ++j) f[j] = f[j] * inv * load_x(norm_w, dtype, j);
  }
}

// Where element j of block b lands in a quantised row. pair: blocks 2i and 2i+1 interleaved by halves,
// [x_2i[0:16], x_2i+1[0:16], x_2i[16:32], x_2i+1[16:32]], matching one 32-byte load of two Q4_1 blocks
// (low nibbles = first halves, high nibbles = second halves); the last block of an odd count stays plain.
inline int64_t slot(int64_t b, int64_t j, int64_t nb, bool pair) {
  if (!pair || (b == nb - 1 && nb % 2)) return b * kBlock + j;
  return (b & ~int64_t{1}) * kBlock + (j >= 16) * 32 + (b & 1) * 16 + (j & 15);
}

// One row of K fp32 values -> K int8 (in `slot` order), K/32 scales a and K/32 sums s = a * sum(q).
void quantize_row(const float* f, int64_t K, int8_t* q, float* a, float* s, bool pair) {
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const float* buf = f + b * kBlock;
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(buf[j]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(buf[j] * inv));
      q[slot(b, j, nb, pair)] = static_cast<int8_t>(v);
      sum += v;
    }
    a[b] = d;
    s[b] = d * static_cast<float>(sum);
  }
}

#if CS_Q_AVX2
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// Per-block scales of R weight rows times the activation row's, each written 4 times (one 8-lane vector scales
// the 4 + 4 int32 lanes of a block pair): sc[(r * nb + b) * 4 + i] = d[r][b] * a[b], and the Q4_1 minimum terms
// mins[r] = sum_b m[r][b] * s[b] (vectorised over 8 blocks on AVX2: vcvtph2ps).
template <int R>
void block_scales(const uint16_t* wd, const uint16_t* wm, int64_t nb, const float* xa, const float* xs, float* sc,
                  float* mins) {
  for (int r = 0; r < R; ++r) {
    int64_t b = 0;
    float msum = 0.0f;
#if CS_Q_AVX2
    __m256 mv = _mm256_setzero_ps();
    const __m256i i0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i step = _mm256_set1_epi32(2);
    for (; b + 8 <= nb; b += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + r * nb + b)));
      const __m256 v = _mm256_mul_ps(d, _mm256_loadu_ps(xa + b));
      __m256i idx = i0;
      for (int k = 0; k < 4; ++k, idx = _mm256_add_epi32(idx, step))
        _mm256_storeu_ps(sc + (r * nb + b) * 4 + 8 * k, _mm256_permutevar8x32_ps(v, idx));
      if (wm != nullptr) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + r * nb + b)));
        mv = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + b), mv);
      }
    }
    msum = hsum(mv);
#endif
    for (; b < nb; ++b) {
      const float v = fp16_to_f(wd[r * nb + b]) * xa[b];
      for (int i = 0; i < 4; ++i) sc[(r * nb + b) * 4 + i] = v;
      if (wm != nullptr) msum += fp16_to_f(wm[r * nb + b]) * xs[b];
    }
    mins[r] = msum;
  }
}

// Dot products of R consecutive weight rows with one quantised activation row (sc, mins from block_scales).
template <int R>
void dot_q4_1(const uint8_t* wq, int64_t nb, const int8_t* xq, const float* sc, const float* mins, float* out) {
#if CS_Q_AVX2
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {  // two blocks a step: 32 bytes of nibbles, activations in `slot` pair order
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock + 32));
    for (int r = 0; r < R; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (r * nb + b) * 16));
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      // int16 sums stay within 2 * 2 * 15 * 127: no saturation
      const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
      const __m256i p = _mm256_madd_epi16(p16, ones);  // lanes 0-3: block b, 4-7: block b + 1
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_loadu_ps(sc + (r * nb + b) * 4), acc[r]);
    }
  }
  if (b < nb) {  // the last block of an odd count (plain order)
    const __m128i m4h = _mm_set1_epi8(0x0f);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    for (int r = 0; r < R; ++r) {
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + (r * nb + b) * 16));
      const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(w, 4), m4h), _mm_and_si128(w, m4h));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sc + (r * nb + b) * 4), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + mins[r];
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* w = wq + (r * nb + b) * 16;
      const int8_t* x = xq + b * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < 16; ++j) dot += (w[j] & 0x0f) * x[j] + (w[j] >> 4) * x[j + 16];
      acc += sc[(r * nb + b) * 4] * static_cast<float>(dot);
    }
    out[r] = acc + mins[r];
  }
#endif
}

template <int R>
void dot_q8_0(const int8_t* wq, int64_t nb, const int8_t* xq, const float* sc, float* out) {
#if CS_Q_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    for (int r = 0; r < R; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (r * nb + b) * kBlock));
      // |w| (unsigned) times x with w's sign: the u8 x s8 product vpmaddubsw needs
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sc + (r * nb + b) * 4), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* w = wq + (r * nb + b) * kBlock;
      const int8_t* x = xq + b * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += w[j] * x[j];
      acc += sc[(r * nb + b) * 4] * static_cast<float>(dot);
    }
    out[r] = acc;
  }
#endif
}

struct Args {
  int wtype;  // 0: Q4_1, 1: Q8_0
  const uint8_t* wq;
  const uint16_t* wd;
  const uint16_t* wm;
  int64_t N, K, M;
  const int8_t* xq;
  const float* xa;
  const float* xs;
  void* y;
  int ydtype;  // 0 fp32, 1 bf16
  int64_t ldy;
  const void* bias;  // ydtype, [N] or null
  bool accumulate;  // y += x . W^T instead of y =
};

// Columns [n0, n0 + R) for activation rows [m0, m1).
template <int R>
void columns(const Args& g, int64_t n0, int64_t m0, int64_t m1) {
  const int64_t nb = g.K / kBlock;
  float out[R], mins[R], sc[R * kMaxBlocks * 4];
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* xq = g.xq + m * g.K;
    block_scales<R>(g.wd + n0 * nb, g.wtype == 0 ? g.wm + n0 * nb : nullptr, nb, g.xa + m * nb, g.xs + m * nb, sc,
                    mins);
    if (g.wtype == 0) {
      dot_q4_1<R>(g.wq + n0 * nb * 16, nb, xq, sc, mins, out);
    } else {
      dot_q8_0<R>(reinterpret_cast<const int8_t*>(g.wq) + n0 * g.K, nb, xq, sc, out);
    }
    for (int r = 0; r < R; ++r) {
      float v = out[r];
      if (g.bias != nullptr) v += load_x(g.bias, g.ydtype, n0 + r);
      if (g.ydtype == 0) {
        float* y = static_cast<float*>(g.y) + m * g.ldy + n0 + r;
        *y = g.accumulate ? *y + v : v;
      } else {
        uint16_t* y = static_cast<uint16_t*>(g.y) + m * g.ldy + n0 + r;
        *y = f_to_bf16(g.accumulate ? bf16_to_f(*y) + v : v);
      }
    }
  }
}

void column_range(const Args& g, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) columns<4>(g, n, m0, m1);
  for (; n < n1; ++n) columns<1>(g, n, m0, m1);
}

// In-place RoPE of the first `cols` values of row y[off:] (heads of d values): v = v * c + swap_halves(v) * s.
void rope_row(void* y, int ydtype, int64_t off, const void* c, const void* s, int64_t cols, int64_t d) {
  float v[1024];
  const int64_t half = d / 2;
  for (int64_t h0 = 0; h0 < cols; h0 += d) {
    for (int64_t j = 0; j < d; ++j) v[j] = load_x(y, ydtype, off + h0 + j);
    for (int64_t j = 0; j < d; ++j) {
      const float r = v[j] * load_x(c, ydtype, j) + v[j < half ? j + half : j - half] * load_x(s, ydtype, j);
      if (ydtype == 0) {
        static_cast<float*>(y)[off + h0 + j] = r;
      } else {
        static_cast<uint16_t*>(y)[off + h0 + j] = f_to_bf16(r);
      }
    }
  }
}

}  // namespace

extern "C" {

// The constant half of a call (one per bound weight, filled by the caller once): weights, shape, output.
struct CsQWeight {
  int32_t wtype;  // 0: Q4_1, 1: Q8_0
  int32_t ydtype;  // output: 0 fp32, 1 bf16
  const void* wq;
  const void* wd;
  const void* wm;  // Q4_1 minima, else null
  const void* bias;  // [N] in ydtype, or null
  int64_t N, K;
  const void* norm_w;  // prologue RMSNorm weight [K] in the input dtype, or null
  float eps;  // its epsilon
  int32_t glu;  // prologue SwiGLU: x rows hold 2K values (gate, up)
};

int cs_q_abi_version() { return 4; }
int cs_q_simd() { return CS_Q_AVX2; }

// y[M, N] (row stride ldy, in w->ydtype) = (or +=, with accumulate) prologue(x[M, K]) . W^T (+ bias); x fp32
// (xdtype 0) or bf16 (1), row stride ldx (2K values a row with w->glu).
// The quantised activations live in a per-thread scratch that grows as needed.
// Returns 0, or a negative code for unsupported arguments.
// RoPE epilogue (rope_cols > 0): the first rope_cols output columns are heads of head_dim values, rotated in
// place as y = y * cos + swap_halves(y) * sin with rope_cos/rope_sin: [M, head_dim] in ydtype (sin signed: -sin
// on the first half), i.e. transformers' rotate-half. Needs rope_cols % head_dim == 0 and head_dim even.
int cs_q_linear(const CsQWeight* w, const void* x, int xdtype, int64_t M, int64_t ldx, void* y, int64_t ldy,
                int accumulate, const void* rope_cos, const void* rope_sin, int64_t rope_cols, int64_t head_dim,
                int nthreads) {
  const int64_t N = w->N, K = w->K;
  if (K % kBlock != 0 || K / kBlock > kMaxBlocks || N <= 0 || M < 0 || (w->wtype != 0 && w->wtype != 1) ||
      xdtype < 0 || xdtype > 1 || w->ydtype < 0 || w->ydtype > 1 || (w->wtype == 0 && w->wm == nullptr))
    return -1;
  if (rope_cols > 0 && (head_dim <= 0 || head_dim % 2 || head_dim > 1024 || rope_cols % head_dim || rope_cols > N ||
                        rope_cos == nullptr || rope_sin == nullptr))
    return -2;
  if (M == 0) return 0;
  const size_t ysize = w->ydtype == 0 ? 4 : 2;
  const int64_t nb = K / kBlock;
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> fbuf;
  if (static_cast<int64_t>(qbuf.size()) < M * K) qbuf.resize(M * K);
  if (static_cast<int64_t>(fbuf.size()) < 2 * M * nb) fbuf.resize(2 * M * nb);
  int8_t* xq = qbuf.data();
  float *xa = fbuf.data(), *xs = fbuf.data() + M * nb;
  Args g{w->wtype, static_cast<const uint8_t*>(w->wq), static_cast<const uint16_t*>(w->wd),
         static_cast<const uint16_t*>(w->wm), N, K, M, xq, xa, xs, y, w->ydtype, ldy, w->bias, accumulate != 0};
  const int64_t units = (N + kColGrain - 1) / kColGrain;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > units) nthreads = static_cast<int>(units);
  const size_t xsize = xdtype == 0 ? 4 : 2;
  auto quantize = [&](int64_t m) {
    thread_local std::vector<float> row;
    if (static_cast<int64_t>(row.size()) < K) row.resize(K);
    load_row(static_cast<const char*>(x) + m * ldx * xsize, xdtype, K, w->glu != 0, w->norm_w, w->eps, row.data());
    quantize_row(row.data(), K, xq + m * K, xa + m * nb, xs + m * nb, CS_Q_AVX2 && w->wtype == 0);
  };
  auto work = [&](int t, int nt) {  // contiguous column ranges per thread, activation rows in L2-sized tiles
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    const int64_t n0 = u0 * kColGrain, n1 = u1 * kColGrain < N ? u1 * kColGrain : N;
    for (int64_t m0 = 0; m0 < M; m0 += kTileM) column_range(g, n0, n1, m0, m0 + kTileM < M ? m0 + kTileM : M);
  };
  auto rope = [&](int64_t m) {
    rope_row(y, w->ydtype, m * ldy, static_cast<const char*>(rope_cos) + m * head_dim * ysize,
             static_cast<const char*>(rope_sin) + m * head_dim * ysize, rope_cols, head_dim);
  };
  if (nthreads == 1) {  // no parallel region to enter (and wait on) for small calls
    for (int64_t m = 0; m < M; ++m) quantize(m);
    work(0, 1);
    for (int64_t m = 0; m < (rope_cols > 0 ? M : 0); ++m) rope(m);
    return 0;
  }
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize(m);
    work(omp_get_thread_num(), omp_get_num_threads());
    if (rope_cols > 0) {
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) rope(m);
    }
  }
  return 0;
}

}  // extern "C"
