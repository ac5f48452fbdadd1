// Per-thread scratch of the phase-1 run kernel (run_cpu.cpp), kept by each pool thread across calls.
#pragma once
#include <cstdint>
#include <vector>

namespace {

// Scratch only grows: a thread's buffers outlive the call, so a smaller call neither frees nor re-zeroes them.
template <typename V> void grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

struct Scratch {
  std::vector<float> qt, acc, m, l, st, kf, vf_;
  std::vector<uint32_t> pp, vp;  // bf16 pairs of probabilities and values (run_bf16.h)
  std::vector<uint16_t> qb, pb;  // AMX: bf16 query rows, bf16 probabilities (run_amx.h)
  std::vector<uint32_t> kt;      // AMX: transposed key pairs of a segment (vp: its value pairs)
  std::vector<int32_t> lim;      // AMX causal runs: each row's key limit within the segment
};

}  // namespace
