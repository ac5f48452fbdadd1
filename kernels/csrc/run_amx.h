// Phase 1 of TPP attention on bf16 chunks with AMX tiles (Sapphire Rapids and later): one `tdpbf16ps`
// multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums, 8,192 multiply-adds per
// instruction against vdpbf16ps's 32, so a run's stacked queries (M = rows x GQA group, 16 per tile row
// block) against a chunk become matrix work at AMX rates. Included by run_cpu.cpp; compiled in only where
// -march=native has AMX-BF16, and used only after Linux grants the process AMX state (arch_prctl).
//
// An item's chunks are cut into key blocks of up to 64 keys and grouped into segments of 16 blocks, packed
// once: key pairs transposed (kt [d/2, 64] per block, the B tiles of S) and value pairs (vp [32, d], the B
// tiles of P V). Then per pair of 16-row blocks of queries (bf16 [32, d], the A tiles of S; a lone last block
// alone), so that each key and value tile loaded from L2 serves 32 rows:
//   S [32, 1024] = Q K^T                    2 x 2 fp32 tiles at a time, each row's max taken as its block lands
//   softmax       exact over the segment, per row, vectorised over keys (one pass: exp, sum, bf16 P)
//   O [32, d]     = P V, 2 x 2 tiles (32 columns of d) kept in the tiles over the whole segment
// and the segment's (O, max, sum) is merged online into the row block's running (acc, m, l).
// Queries and probabilities are rounded to bf16 (nearest even) as in run_bf16.h, sums stay fp32, and the
// softmax scale multiplies the fp32 scores. Only valid key slots are read: key pairs, value pairs and
// probabilities past the chunk's valid tokens are zeros, so NaN in free pool slots never reaches a result.
#pragma once
#include <cstdint>

#include "run_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(CS_RUN_DPBF16)
#define CS_RUN_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace cs_amx {

constexpr int64_t kKeys = 64;       // keys per key block: four 16-key tiles of S
constexpr int64_t kSegBlocks = 16;  // key blocks per segment (1,024 key slots): one exact softmax each

// Linux hands a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
// CHUNKSERVE_AMX=0 keeps the vdpbf16ps path.
inline bool permitted() {
  static const bool ok = [] {
    const char* e = std::getenv("CHUNKSERVE_AMX");
    if (e != nullptr && e[0] == '0') return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

// Whether a head dim fits the tiles: S steps over d in 32s, O in 64-column halves.
inline bool usable(int64_t d) { return d % 64 == 0 && permitted(); }

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes. Tile state is per thread: call before a thread's first tile op.
inline void configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
}

// A 16 x 16 block of 32-bit words transposed in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 0-3 with 4-7, and 8-11 with 12-15
    t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// kt [d/2, 64] = the key pairs of nt <= 64 keys transposed (word i of key t at kt[i * 64 + t]); zeros past nt.
inline void pack_keys(const uint16_t* k, int64_t nt, int64_t d, uint32_t* kt) {
  const int64_t dh = d / 2;
  const uint32_t* kw = reinterpret_cast<const uint32_t*>(k);
  for (int64_t t0 = 0; t0 < kKeys; t0 += 16)
    for (int64_t i0 = 0; i0 < dh; i0 += 16) {
      __m512i r[16];
      for (int64_t x = 0; x < 16; ++x)
        r[x] = t0 + x < nt ? _mm512_loadu_si512(kw + (t0 + x) * dh + i0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t x = 0; x < 16; ++x) _mm512_storeu_si512(kt + (i0 + x) * kKeys + t0, r[x]);
    }
}

// A segment: up to kSegBlocks key blocks of up to 64 valid keys each, packed once per item (kt, vp) and
// then used by every 16-row block of queries. Its scores fit in one [16, 1024] buffer, so the softmax of a
// segment is exact (one max per row, no rescaling between chunks), and O stays in the tiles for the
// whole segment; segments are merged online.
struct Segment {
  int64_t nblk = 0;
  int64_t valid[kSegBlocks];  // valid keys of each block
  int64_t start[kSegBlocks];  // its first key's index in the segment (blocks of short chunks hold < 64 keys)
  uint32_t* kt;               // [kSegBlocks, d/2, 64] transposed key pairs
  uint32_t* vp;               // [kSegBlocks, 32, d] value pairs
};

// Scratch of one thread: s [32, kLd] fp32 scores, p [32, kLdP] bf16 probabilities, o [32, d] fp32 (two row
// blocks at a time).
struct Buffers {
  float* s;
  uint16_t* p;
  float* o;
};

inline void add_block(Segment& seg, const uint16_t* k, const uint16_t* v, int64_t nt, int64_t d) {
  const int64_t b = seg.nblk++, nks = (nt + 31) / 32;
  seg.valid[b] = nt;
  seg.start[b] = b > 0 ? seg.start[b - 1] + seg.valid[b - 1] : 0;
  pack_keys(k, nt, d, seg.kt + b * d / 2 * kKeys);
  uint32_t* vp = seg.vp + b * 32 * d;
  cs_dp::pack_values(v, nt, d, vp);
  std::memset(vp + (nt + 1) / 2 * d, 0, sizeof(uint32_t) * (nks * 16 - (nt + 1) / 2) * d);
}

// Output tiles 0-3 += A [16, 32 bf16] (a, row stride lda bytes) times four B tiles of 16 pair-rows x 16
// columns at b, b + 16, b + 32, b + 48 words (row stride ldb bytes).
inline void dp4(const void* a, int64_t lda, const uint32_t* b, int64_t ldb) {
  _tile_loadd(4, a, lda);
  _tile_loadd(5, b, ldb);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b + 16, ldb);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(7, b + 32, ldb);
  _tile_dpbf16ps(2, 4, 7);
  _tile_loadd(5, b + 48, ldb);
  _tile_dpbf16ps(3, 4, 5);
}

// Row strides of the score (fp32) and probability (bf16) buffers: a segment's 1,024 slots plus one cache line, so
// that the 32 rows of a tile pair fall in different L1 sets (a 4 KiB stride puts them all in one set).
constexpr int64_t kLd = kSegBlocks * kKeys + 16;
constexpr int64_t kLdP = kSegBlocks * kKeys + 32;

// Row maxima of key block b's scores, just stored (so read from L1), folded into mv [rows] (16 lanes each):
// the softmax's max pass without a second read of the segment's scores.
inline __mmask16 first_n(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// Causal rows (lim not null): row x sees the segment's keys [0, lim[x]) only.
inline __mmask16 row_mask(__mmask16 k, const int32_t* lim, int64_t x, int64_t key) {
  return lim == nullptr ? k : static_cast<__mmask16>(k & first_n(lim[x] - key));
}

inline void block_max(const Segment& seg, int64_t b, const float* s, int64_t rows, const int32_t* lim, __m512* mv) {
  for (int j = 0; j < 4; ++j) {
    const int64_t n = seg.valid[b] - 16 * j;
    if (n <= 0) break;
    for (int64_t x = 0; x < rows; ++x)
      mv[x] = _mm512_mask_max_ps(mv[x], row_mask(first_n(n), lim, x, seg.start[b] + 16 * j), mv[x],
                                 _mm512_loadu_ps(s + x * kLd + b * kKeys + 16 * j));
  }
}

// S [16 R, 64 * nblk] of R = 1 or 2 row blocks (bf16 rows q [16 R, d]) into s (row stride kLd), unscaled, with
// each row's max in mv. Two row blocks share every key tile load (the segment's key pairs come from L2):
// tiles 0-3 = {block 0, block 1} x {key tile 2k, 2k + 1}, A tiles 4-5, B tiles 6-7.
template <int R>
__attribute__((noinline)) void seg_scores(const uint16_t* q, const Segment& seg, int64_t d, float* s,
                                          const int32_t* lim, __m512* mv) {
  for (int64_t b = 0; b < seg.nblk; ++b) {
    const uint32_t* kb = seg.kt + b * d / 2 * kKeys;
    float* sb = s + b * kKeys;
    if constexpr (R == 1) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kd = 0; kd < d / 32; ++kd) dp4(q + kd * 32, d * 2, kb + kd * 16 * kKeys, kKeys * 4);
      _tile_stored(0, sb, kLd * 4);
      _tile_stored(1, sb + 16, kLd * 4);
      _tile_stored(2, sb + 32, kLd * 4);
      _tile_stored(3, sb + 48, kLd * 4);
    } else {
      for (int64_t t = 0; t < seg.valid[b]; t += 32) {  // key tiles past the valid keys are never read
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kd = 0; kd < d / 32; ++kd) {
          _tile_loadd(4, q + kd * 32, d * 2);
          _tile_loadd(5, q + 16 * d + kd * 32, d * 2);
          _tile_loadd(6, kb + kd * 16 * kKeys + t, kKeys * 4);
          _tile_loadd(7, kb + kd * 16 * kKeys + t + 16, kKeys * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sb + t, kLd * 4);
        _tile_stored(1, sb + t + 16, kLd * 4);
        _tile_stored(2, sb + 16 * kLd + t, kLd * 4);
        _tile_stored(3, sb + 16 * kLd + t + 16, kLd * 4);
      }
    }
    block_max(seg, b, s, 16 * R, lim, mv);
  }
}

// Softmax of ``rows`` rows' scores over the segment's valid keys, given their maxima mv: p = bf16(exp(scale * s
// - mx)), with mx[x] and sum[x] (of the fp32 values, before rounding) returned; invalid slots get p = 0.
__attribute__((noinline)) void seg_exp(const Segment& seg, const float* s, int64_t rows, float scale,
                                       const int32_t* lim, const __m512* mv, uint16_t* p, float* mx, float* sum) {
  const __m512 sc = _mm512_set1_ps(scale);
  __mmask16 valid[kSegBlocks * 4];
  for (int64_t b = 0; b < seg.nblk; ++b)
    for (int j = 0; j < 4; ++j) valid[b * 4 + j] = first_n(seg.valid[b] - 16 * j);
  const int64_t nv = seg.nblk * 4;
  for (int64_t x = 0; x < rows; ++x) {
    const float* sr = s + x * kLd;
    const float mxs = _mm512_reduce_max_ps(mv[x]) * scale;  // scale > 0: the max of scaled scores
    const __m512 vm = _mm512_set1_ps(mxs);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < nv; ++j) {
      const __m512 z = _mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * j), sc, vm);
      const __mmask16 k = row_mask(valid[j], lim, x, seg.start[j / 4] + 16 * (j % 4));
      const __m512 e = _mm512_maskz_mov_ps(k, cs_dp::exp16(z));
      acc = _mm512_add_ps(acc, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + x * kLdP + 16 * j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    mx[x] = mxs;
    sum[x] = _mm512_reduce_add_ps(acc);
  }
}

// o [16 R, d] = P [16 R, 64 * nblk] V over the segment's value pairs (o row stride d). One row block: tiles 0-3
// are 64 columns of d; two: {block 0, block 1} x 32 columns, sharing each value tile load.
template <int R>
__attribute__((noinline)) void seg_pv(const Segment& seg, const uint16_t* p, int64_t d, float* o) {
  for (int64_t c0 = 0; c0 < d; c0 += 64 / R) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < seg.nblk; ++b)
      for (int64_t ks = 0; ks < (seg.valid[b] + 31) / 32; ++ks) {
        const uint16_t* pa = p + b * kKeys + ks * 32;
        const uint32_t* vb = seg.vp + (b * 32 + ks * 16) * d + c0;
        if constexpr (R == 1) {
          dp4(pa, kLdP * 2, vb, d * 4);
        } else {
          _tile_loadd(4, pa, kLdP * 2);
          _tile_loadd(5, pa + 16 * kLdP, kLdP * 2);
          _tile_loadd(6, vb, d * 4);
          _tile_loadd(7, vb + 16, d * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    if constexpr (R == 1) {
      _tile_stored(0, o + c0, d * 4);
      _tile_stored(1, o + c0 + 16, d * 4);
      _tile_stored(2, o + c0 + 32, d * 4);
      _tile_stored(3, o + c0 + 48, d * 4);
    } else {
      _tile_stored(0, o + c0, d * 4);
      _tile_stored(1, o + c0 + 16, d * 4);
      _tile_stored(2, o + 16 * d + c0, d * 4);
      _tile_stored(3, o + 16 * d + c0 + 16, d * 4);
    }
  }
}

// R = 1 or 2 row blocks (bf16 queries q [16 R, d]) against a segment, merged online into their running (acc, m, l)
// (rows contiguous); acc [16 R, d] is unnormalised, m = -inf marks rows with nothing yet.
// Causal rows (``lim`` not null, segment-relative): row x sees keys [0, lim[x]); key blocks past every row's limit
// are skipped, and a row with no key in the segment adds nothing.
template <int R>
void seg_rows(const Segment& seg, const uint16_t* q, int64_t d, float scale, const Buffers& buf, const int32_t* lim,
              float* acc, float* m, float* l) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  Segment sv = seg;
  if (lim != nullptr) {
    const int64_t top = *std::max_element(lim, lim + 16 * R);
    while (sv.nblk > 0 && sv.start[sv.nblk - 1] >= top) --sv.nblk;  // blocks no row sees
  }
  alignas(64) float mx[16 * R], sum[16 * R];
  __m512 mv[16 * R];
  for (auto& v : mv) v = _mm512_set1_ps(ninf);
  seg_scores<R>(q, sv, d, buf.s, lim, mv);
  seg_exp(sv, buf.s, 16 * R, scale, lim, mv, buf.p, mx, sum);
  const bool first = m[0] == ninf;  // every row of an item starts together (a causal row sees its run's first key)
  seg_pv<R>(sv, buf.p, d, first ? acc : buf.o);
  for (int64_t x = 0; x < 16 * R; ++x) {
    if (first) {
      m[x] = mx[x];
      l[x] = sum[x];
      continue;
    }
    if (mx[x] == ninf) continue;  // no key of this segment for the row
    const float mn = std::max(m[x], mx[x]), a_old = std::exp(m[x] - mn), a_new = std::exp(mx[x] - mn);
    const __m512 vo = _mm512_set1_ps(a_old), vn = _mm512_set1_ps(a_new);
    for (int64_t j = 0; j < d; j += 16)
      _mm512_storeu_ps(acc + x * d + j, _mm512_fmadd_ps(_mm512_loadu_ps(acc + x * d + j), vo,
                                                        _mm512_mul_ps(_mm512_loadu_ps(buf.o + x * d + j), vn)));
    m[x] = mn;
    l[x] = l[x] * a_old + sum[x] * a_new;
  }
}

}  // namespace cs_amx
#endif
