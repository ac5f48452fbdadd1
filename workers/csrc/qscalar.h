// Scalar Q4_1 / Q8_0 group kernels of qmatmul.cpp (a build without AVX2): the same integer block sums and the
// same fused multiply-adds, in the same order, as the vector forms there. Included inside qmatmul.cpp's
// anonymous namespace (it uses kQ4Bytes, kQ8Bytes, kGroup and kBlock from there).
#pragma once

template <int MT>
void group_q4(const uint8_t* pw, int64_t nb, const int8_t* xq, int64_t K, const float* xa, const float* xs,
              float* out, int64_t ldo) {
  float acc[MT][kGroup] = {};
  for (int64_t b = 0; b < nb; ++b, pw += kQ4Bytes) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = xq + m * K + b * kBlock;
      for (int r = 0; r < kGroup; ++r) {
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) {
            const uint8_t w = pw[32 * i + 4 * r + j];
            dot += (w & 0x0f) * x[4 * i + j] + (w >> 4) * x[16 + 4 * i + j];
          }
        const float d = fp16_to_f(reinterpret_cast<const uint16_t*>(pw + 128)[r]);
        const float mn = fp16_to_f(reinterpret_cast<const uint16_t*>(pw + 144)[r]);
        acc[m][r] = std::fma(static_cast<float>(dot), d * xa[m * nb + b], acc[m][r]);
        acc[m][r] = std::fma(mn, xs[m * nb + b], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kGroup; ++r) out[m * ldo + r] = acc[m][r];
}

template <int MT>
void group_q8(const uint8_t* pw, int64_t nb, const int8_t* xq, int64_t K, const float* xa, const float* /*xsum*/,
              float* out, int64_t ldo) {
  float acc[MT][kGroup] = {};
  for (int64_t b = 0; b < nb; ++b, pw += kQ8Bytes) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = xq + m * K + b * kBlock;
      for (int r = 0; r < kGroup; ++r) {
        int32_t dot = 0;
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 4; ++j) dot += (static_cast<int32_t>(pw[32 * i + 4 * r + j]) - 128) * x[4 * i + j];
        const float d = fp16_to_f(reinterpret_cast<const uint16_t*>(pw + 256)[r]);
        acc[m][r] = std::fma(static_cast<float>(dot), d * xa[m * nb + b], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kGroup; ++r) out[m * ldo + r] = acc[m][r];
}
