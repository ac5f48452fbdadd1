// Block-quantised linear layers for the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), llama.cpp style.
//
// Weights, in blocks of 32 along K (K % 32 == 0):
//   Q4_1: 16 bytes per block (byte j: element j in the low nibble, element j + 16 in the high one),
//         fp16 scale d and fp16 minimum m per block: w = d * q + m, q in [0, 15].
//   Q8_0: 32 int8 per block and an fp16 scale d per block: w = d * q, q in [-127, 127].
// Activations are quantised per row and per block of 32 to int8 (Q8_1: scale a = amax / 127, q = round(x / a),
// plus s = a * sum(q) for the Q4_1 minimum term), so each block is one integer dot product:
//   Q4_1: sum_k w_k x_k = d * a * sum(q_w q_x) + m * s;   Q8_0: d * a * sum(q_w q_x).
// The weights are repacked at bind time into groups of 8 output rows (see "Packed weights"): on AVX2 one
// vpmaddubsw covers 4 elements of 8 rows, so 8 rows' block sums land in one vector; elsewhere a scalar loop
// computes the same integer sums and the same fused multiply-adds in the same order.
//
// Threads: one OpenMP team (the runtime torch already loaded); rows of x are quantised first, then the
// output columns are split into ranges of 8-row groups that the threads take as they come free. Every output
// element is the same sum in the same order whatever the batch and the thread count (batch-invariant and
// deterministic).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "b16.h"
#include "qwide.h"
#include "qact.h"

namespace {

using namespace csq;
constexpr int64_t kTileM = 64;  // activation rows per tile (64 x K int8 stays in L2)

// Packed weights: groups of 8 output rows (N padded to a multiple of 8 with zero rows), block after block.
// One block of a group: lanes of 4 bytes, lane L = row L, so that one integer vector op works on 8 rows and
// the 8 int32 lanes of its result are already the 8 rows' sums (no horizontal adds, no scale shuffles):
//   Q4_1 (160 bytes): 4 x 32 bytes, vector i = bytes 4i..4i+3 of each row's 16 nibble bytes (low nibbles:
//         elements 4i..4i+3, high: 16+4i..16+4i+3), then d[8] and m[8] fp16;
//   Q8_0 (272 bytes): 8 x 32 bytes, vector i = elements 4i..4i+3 of each row stored offset by 128 (q + 128 as
//         an unsigned byte: vpdpbusd's unsigned operand as it is), then d[8] fp16.
// Per block and activation row the result is acc += float(isum) * (d * a) (+ m * s for Q4_1), with
// isum exact, in block order: the same sums in the same order whatever M, the row tile and the threads.
constexpr int64_t kGroup = 8;
constexpr int64_t kQ4Bytes = 160, kQ8Bytes = 272;

#include "qnarrow.h"  // the narrow tiles: one group x up to 4 activation rows (AVX2, or scalar)

struct Args {
  int wtype;  // 0: Q4_1, 1: Q8_0, 2: bf16 (b16.h)
  const uint8_t* pw;  // packed groups
  int64_t N, K, M;
  const int8_t* xq;
  const uint16_t* xb;  // bf16 activations [M, K] (weight type 2)
  const uint32_t* xi;  // the same, interleaved tile by tile for the native bf16 tiles (b16.h), or null
  const float* xa;
  const float* xs;  // per row and block: a * sum(q) for Q4_1; the exact integer sum(q) for Q8_0
  const int32_t* xw;  // Q8_0 / Q4_1 with the wide tiles (qwide.h): xq interleaved tile by tile, or null
  const float* xat;  // ... and xa, and per block -128 * sum(q) (Q8_0) or the bits of a * sum(q) (Q4_1), likewise
  const int32_t* xot;
  void* y;
  int ydtype;  // 0 fp32, 1 bf16
  int64_t ldy;
  const void* bias;  // ydtype, [N] or null
  bool accumulate;  // y += x . W^T instead of y =
};

template <int MT>
void group_rows(const Args& g, int64_t grp, int64_t m, float* out) {
  const int64_t nb = g.K / kBlock;
  if (MT > 4 || g.wtype == 2) {  // 8-row tiles for bf16 weights only
    group_b16<MT>(g.pw + grp * nb * kB16Bytes, nb, g.xb + m * g.K, g.K, out, kGroup);
  } else if (g.wtype == 0) {
    group_q4<MT>(g.pw + grp * nb * kQ4Bytes, nb, g.xq + m * g.K, g.K, g.xa + m * nb, g.xs + m * nb, out, kGroup);
  } else {
    group_q8<MT>(g.pw + grp * nb * kQ8Bytes, nb, g.xq + m * g.K, g.K, g.xa + m * nb, g.xs + m * nb, out, kGroup);
  }
}

#if CS_Q_AVX2
// 8 consecutive outputs v of one row -> y: store_scalar's arithmetic below, 8 lanes at a time (the same bits).
inline __m256i bf16_bits8(__m256 x) {  // as f_to_bf16, in the low 16 bits of each lane
  const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                       _mm256_and_si256(hi, _mm256_set1_epi32(1))), 16);
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}
__attribute__((always_inline)) inline void store8(const float* v, const void* bias, int ydtype, bool accumulate, void* y) {
  __m256 x = _mm256_loadu_ps(v);
  if (ydtype == 0) {
    if (bias != nullptr) x = _mm256_add_ps(x, _mm256_loadu_ps(static_cast<const float*>(bias)));
    float* yf = static_cast<float*>(y);
    _mm256_storeu_ps(yf, accumulate ? _mm256_add_ps(_mm256_loadu_ps(yf), x) : x);
    return;
  }
  if (bias != nullptr) x = _mm256_add_ps(x, load8(bias, 1, 0));
  if (accumulate)  // ATen: y + round(v)
    x = _mm256_add_ps(load8(y, 1, 0), _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16)));
  const __m256i b = bf16_bits8(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);  // lanes 0-7 in the low half
  _mm_storeu_si128(static_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}
#endif

// The rows store_tile cannot store as vectors: its arithmetic one output at a time (out of line: rare).
__attribute__((noinline)) void store_scalar(const Args& g, int64_t n0, int64_t rows, int64_t m, int64_t mt,
                                            const float* out, int64_t ldo) {
  for (int64_t i = 0; i < mt; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      float v = out[i * ldo + r];
      if (g.bias != nullptr) v += load_x(g.bias, g.ydtype, n0 + r);
      if (g.ydtype == 0) {
        float* y = static_cast<float*>(g.y) + (m + i) * g.ldy + n0 + r;
        *y = g.accumulate ? *y + v : v;
      } else {
        uint16_t* y = static_cast<uint16_t*>(g.y) + (m + i) * g.ldy + n0 + r;
        *y = f_to_bf16(g.accumulate ? bf16_to_f(*y) + round_to(1, v) : v);  // ATen: y + round(v)
      }
    }
  }
}

// Add bias, round and write (or accumulate) the tile's rows [m, m + mt) x outputs [n0, n0 + width) from out.
// Inlined into the tile loops: a decode row stores its 8 outputs without a call (one per 8 outputs otherwise).
__attribute__((always_inline)) inline void store_tile(const Args& g, int64_t n0, int64_t width, int64_t m, int64_t mt,
                                                      const float* out, int64_t ldo) {
  const int64_t rows = g.N - n0 < width ? g.N - n0 : width;
#if CS_Q_AVX2
  // 8 (narrow tiles) or 16 (wide tiles, qwide.h) outputs a row: store_scalar's arithmetic in vectors, the same bits
  const int64_t ys = g.ydtype == 0 ? 4 : 2;
  const char* bias = g.bias == nullptr ? nullptr : static_cast<const char*>(g.bias) + n0 * ys;
  char* y = static_cast<char*>(g.y) + (m * g.ldy + n0) * ys;
  if (rows == 8) {
    for (int64_t i = 0; i < mt; ++i) store8(out + i * ldo, bias, g.ydtype, g.accumulate, y + i * g.ldy * ys);
    return;
  }
#if CS_Q_WIDE
  if (rows == 16) {
    for (int64_t i = 0; i < mt; ++i) store16(out + i * ldo, bias, g.ydtype, g.accumulate, y + i * g.ldy * ys);
    return;
  }
#endif
#endif
  store_scalar(g, n0, rows, m, mt, out, ldo);
}

#if CS_B16_NATIVE
// Native bf16 weights: each group over the rows in the tiles of `b16_tiles` (b16.h), then the epilogue.
void group_range_b16(const Args& g, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  float out[kB16MaxTile * kGroup];
  const int64_t nb = g.K / kBlock;
  for (int64_t grp = g0; grp < g1; ++grp)
    b16_tiles(g.pw + grp * nb * kB16Bytes, nb, g.xi, g.K, m0, m1, kTileM, out, [&](int64_t m, int mt) {
      store_tile(g, grp * kGroup, kGroup, m, mt, out, kGroup);
    });
}
#endif

#if CS_Q_WIDE
// Q8_0 / Q4_1 over interleaved rows: Q8_0 four groups at a time, then pairs of groups in the wide tiles; returns the
// group left over (g1 when none).
int64_t group_range_qw(const Args& g, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  constexpr int64_t kOut = kQ8QuadTile * 4 > kQ8Tile * 2 ? kQ8QuadTile * 4 : kQ8Tile * 2;
  float out[kOut * kGroup];
  const int64_t nb = g.K / kBlock, bytes = nb * (g.wtype == 1 ? kQ8Bytes : kQ4Bytes);
  const int most = q_tile_max(g.wtype, g.M);  // as the activations were interleaved
  for (; q_quad_for(g.wtype, g.M) && g0 + 3 < g1; g0 += 4)
    q_wide_tiles(g.wtype, 2, g.pw + g0 * bytes, bytes, nb, g.xw, g.xat, g.xot, m0, m1, most, out,
                 [&](int64_t m, int mt) {
                   store_tile(g, g0 * kGroup, 2 * kGroup, m, mt, out, 4 * kGroup);
                   store_tile(g, (g0 + 2) * kGroup, 2 * kGroup, m, mt, out + 2 * kGroup, 4 * kGroup);
                 });
  for (; g0 + 1 < g1; g0 += 2)
    q_wide_tiles(g.wtype, 1, g.pw + g0 * bytes, bytes, nb, g.xw, g.xat, g.xot, m0, m1, most, out,
                 [&](int64_t m, int mt) { store_tile(g, g0 * kGroup, 2 * kGroup, m, mt, out, 2 * kGroup); });
  return g0;
}
#endif

// Row groups [g0, g1) for activation rows [m0, m1): 4 activation rows (8 for bf16 weights without AVX512-BF16)
// share each unpacked weight vector.
void group_range(const Args& g, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
#if CS_B16_NATIVE
  if (g.wtype == 2) return group_range_b16(g, g0, g1, m0, m1);
#endif
#if CS_Q_WIDE
  if (g.xw != nullptr) g0 = group_range_qw(g, g0, g1, m0, m1);
#endif
  float out[8 * kGroup];
  for (int64_t grp = g0; grp < g1; ++grp) {
    for (int64_t m = m0; m < m1;) {
      const int64_t mt = g.wtype == 2 && m1 - m >= 8 ? 8 : m1 - m >= 4 ? 4 : m1 - m >= 2 ? 2 : 1;
      if (mt == 8) {
        group_rows<8>(g, grp, m, out);
      } else if (mt == 4) {
        group_rows<4>(g, grp, m, out);
      } else if (mt == 2) {
        group_rows<2>(g, grp, m, out);
      } else {
        group_rows<1>(g, grp, m, out);
      }
      store_tile(g, grp * kGroup, kGroup, m, mt, out, kGroup);
      m += mt;
    }
  }
}

}  // namespace

extern "C" {

// The constant half of a call (one per bound weight, filled by the caller once): weights, shape, output.
struct CsQWeight {
  int32_t wtype;  // 0: Q4_1, 1: Q8_0, 2: bf16
  int32_t ydtype;  // output: 0 fp32, 1 bf16
  const void* packed;  // ceil(N / 8) groups of K / 32 blocks (see "Packed weights")
  const void* bias;  // [N] in ydtype, or null
  int64_t N, K;
  const void* norm_w;  // prologue RMSNorm weight [K] in the input dtype, or null
  float eps;  // its epsilon
  int32_t glu;  // prologue SwiGLU: x rows hold 2K values (gate, up)
};

int cs_q_abi_version() { return 8; }
int cs_q_simd() { return CS_Q_AVX2; }
int cs_q_avx512() { return CS_Q_AVX512; }  // the prologue and activation quantiser 16 lanes wide (qact.h)
int cs_q_vnni() { return CS_Q_VNNI; }  // block sums by vpdpbusd
int cs_q_bf16() { return CS_B16_NATIVE; }  // bf16 pairs by vdpbf16ps
int64_t cs_q_block_bytes(int wtype) { return wtype == 0 ? kQ4Bytes : wtype == 1 ? kQ8Bytes : kB16Bytes; }

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
  if (K % kBlock != 0 || N <= 0 || M < 0 || w->wtype < 0 || w->wtype > 2 ||
      xdtype < 0 || xdtype > 1 || w->ydtype < 0 || w->ydtype > 1 || w->packed == nullptr)
    return -1;
  if (rope_cols > 0 && (head_dim <= 0 || head_dim % 2 || head_dim > 1024 || rope_cols % head_dim || rope_cols > N ||
                        rope_cos == nullptr || rope_sin == nullptr))
    return -2;
  if (M == 0) return 0;
  const size_t ysize = w->ydtype == 0 ? 4 : 2;
  const int64_t nb = K / kBlock;
  thread_local std::vector<int8_t> qbuf;  // int8 activations, or bf16 ones (2 bytes each) for weight type 2
  thread_local std::vector<float> fbuf;
  const int64_t xbytes = w->wtype == 2 ? 2 * M * K : M * K;
  if (static_cast<int64_t>(qbuf.size()) < xbytes) qbuf.resize(xbytes);
  if (static_cast<int64_t>(fbuf.size()) < 3 * M * nb) fbuf.resize(3 * M * nb);
  int8_t* xq = qbuf.data();
  float *xa = fbuf.data(), *xs = fbuf.data() + M * nb;
  uint16_t* xb = reinterpret_cast<uint16_t*>(xq);
  uint32_t* xi = nullptr;  // native bf16 tiles: xb interleaved, in the row pieces `work` and the threads use (b16.h)
#if CS_B16_NATIVE
  bool interleave = w->wtype == 2;
  thread_local std::vector<uint32_t> ibuf;
  if (interleave && static_cast<int64_t>(ibuf.size()) < b16_interleaved_words(M, K, kTileM))
    ibuf.resize(b16_interleaved_words(M, K, kTileM));
  if (interleave) xi = ibuf.data();
#else
  bool interleave = false;
#endif
  Args g{w->wtype, static_cast<const uint8_t*>(w->packed), N, K, M, xq, xb, xi, xa, xs, nullptr, nullptr, nullptr,
         y, w->ydtype, ldy, w->bias, accumulate != 0};
#if CS_Q_WIDE
  thread_local std::vector<int32_t> wbuf;  // the wide tiles (qwide.h): the interleaved words, then the offsets
  int32_t *xw = nullptr, *xot = nullptr;
  float* xat = fbuf.data() + 2 * M * nb;
  if (w->wtype != 2 && q_wide_for(M, N, K)) {
    if (static_cast<int64_t>(wbuf.size()) < M * K / 4 + M * nb) wbuf.resize(M * K / 4 + M * nb);
    g.xw = xw = wbuf.data(), g.xot = xot = wbuf.data() + M * K / 4, g.xat = xat;
    interleave = true;
  }
#endif
  auto interleave_all = [&]() {  // in the row pieces `work` and the threads use
#if CS_B16_NATIVE
    for (int64_t m0 = 0; m0 < (w->wtype == 2 ? M : 0); m0 += kTileM)
      interleave_b16_tiles(xb, K, m0, m0 + kTileM < M ? m0 + kTileM : M, kTileM, xi);
#endif
#if CS_Q_WIDE
    if (xw != nullptr) interleave_q_rows(xq, xa, xs, M, K, kTileM, w->wtype, xw, xat, xot);
#endif
  };
  const int64_t units = (N + kGroup - 1) / kGroup;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > units) nthreads = static_cast<int>(units);
  const size_t xsize = xdtype == 0 ? 4 : 2;
  auto quantize = [&](int64_t m) {
    if (w->wtype == 2 && xdtype == 1 && w->glu == 0 && w->norm_w == nullptr) {  // already the bf16 it needs
      std::memcpy(xb + m * K, static_cast<const char*>(x) + m * ldx * xsize, K * sizeof(uint16_t));
      return;
    }
    thread_local std::vector<float> row;
    if (static_cast<int64_t>(row.size()) < K) row.resize(K);
    load_row(static_cast<const char*>(x) + m * ldx * xsize, xdtype, K, w->glu != 0, w->norm_w, w->eps, row.data());
    if (w->wtype == 2) {
      bf16_row(row.data(), K, xb + m * K);
    } else {
      quantize_row(row.data(), K, xq + m * K, xa + m * nb, xs + m * nb, w->wtype == 1);
    }
  };
  auto work = [&]() {  // one thread: every row group, activation rows in L2-sized tiles
    for (int64_t m0 = 0; m0 < M; m0 += kTileM) group_range(g, 0, units, m0, m0 + kTileM < M ? m0 + kTileM : M);
  };
  auto rope = [&](int64_t m) {
    rope_row(y, w->ydtype, m * ldy, static_cast<const char*>(rope_cos) + m * head_dim * ysize,
             static_cast<const char*>(rope_sin) + m * head_dim * ysize, rope_cols, head_dim);
  };
  if (nthreads == 1) {  // no parallel region to enter (and wait on) for small calls
    for (int64_t m = 0; m < M; ++m) quantize(m);
    if (interleave) interleave_all();
    work();
    for (int64_t m = 0; m < (rope_cols > 0 ? M : 0); ++m) rope(m);
    return 0;
  }
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize(m);
    if (interleave) {
#pragma omp single
      interleave_all();
    }
    // row groups in pieces taken as threads come free: a thread the OS preempts (a served engine shares its cores
    // with the event loop, ingress and proxy) holds up only the piece it holds, not a fixed share of the call
    const int64_t pieces = units < 4 * nthreads ? units : 4 * nthreads;
#if CS_Q_WIDE
    const int64_t align = g.xw != nullptr && q_quad_for(g.wtype, M) ? 4 : 1;  // pieces of whole four-group tiles
#else
    const int64_t align = 1;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pieces; ++q) {
      const int64_t u0 = units * q / pieces / align * align;
      const int64_t u1 = q + 1 == pieces ? units : units * (q + 1) / pieces / align * align;
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) group_range(g, u0, u1, m0, m0 + kTileM < M ? m0 + kTileM : M);
    }
    if (rope_cols > 0) {
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) rope(m);
    }
  }
  return 0;
}


// A decode step's layer loop as one call (`workers/step_program.py`): `n` records of kOpWords int64 each,
// run in order; stops at the first call that fails and returns its code, with its index in *failed.
//   kind 0, a linear:       [0, w, x, xdtype, M, ldx, y, ldy, accumulate, rope_cos, rope_sin, rope_cols, head_dim,
//                            nthreads] (the arguments of cs_q_linear);
//   kind 1, a foreign call: [1, fn, a0 .. a9] with fn an int(*)(void*, void*, int64, void*, int64, void*, int64,
//                            void*, void*, void*) (`kernels/csrc/decode_cpu.cpp: cs_decode_layer`).
constexpr int64_t kOpWords = 16;
typedef int (*CsLayerFn)(const void*, const void*, int64_t, const void*, int64_t, const void*, int64_t, void*, void*,
                         void*);

int cs_q_run(const int64_t* ops, int64_t n, int64_t* failed) {
  auto ptr = [](int64_t v) { return reinterpret_cast<void*>(static_cast<intptr_t>(v)); };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* o = ops + i * kOpWords;
    int rc;
    if (o[0] == 0) {
      rc = cs_q_linear(static_cast<const CsQWeight*>(ptr(o[1])), ptr(o[2]), static_cast<int>(o[3]), o[4], o[5],
                       ptr(o[6]), o[7], static_cast<int>(o[8]), ptr(o[9]), ptr(o[10]), o[11], o[12],
                       static_cast<int>(o[13]));
    } else if (o[0] == 1 && o[1] != 0) {
      rc = reinterpret_cast<CsLayerFn>(ptr(o[1]))(ptr(o[2]), ptr(o[3]), o[4], ptr(o[5]), o[6], ptr(o[7]), o[8],
                                                   ptr(o[9]), ptr(o[10]), ptr(o[11]));
    } else {
      rc = -100;
    }
    if (rc != 0) {
      if (failed != nullptr) *failed = i;
      return rc;
    }
  }
  return 0;
}

}  // extern "C"
