// Compressor pooling (ops/compressor.h): one task per entry, each channel's
// softmax over its slots in a fixed order, so results do not depend on the
// thread count.
#include "ops/compressor.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {
namespace {

void check_dims(const CompressorDims& d) {
  DS_CHECK(d.tokens >= 0 && d.dim > 0 && d.ratio > 0, "compressor: tokens {} dim {} ratio {}", d.tokens, d.dim,
           d.ratio);
}

// The slots of entry b: (token, channel offset) pairs, previous window's
// first halves first.
struct Slots {
  int64_t first_token[2], count[2], offset[2];
  int groups;
};

Slots slots(int64_t b, const CompressorDims& d) {
  const int64_t m = d.ratio;
  if (!d.overlap) return {{b * m, 0}, {m, 0}, {0, 0}, 1};
  if (b == 0) return {{0, 0}, {m, 0}, {d.dim, 0}, 1};
  return {{(b - 1) * m, b * m}, {m, m}, {0, d.dim}, 2};
}

// Calls f(k) with the index into P and Z of every slot of channel i, in
// slot order.
template <typename F>
void for_slots(const Slots& s, int64_t width, int64_t i, F&& f) {
  for (int g = 0; g < s.groups; ++g)
    for (int64_t j = 0; j < s.count[g]; ++j) f((s.first_token[g] + j) * width + s.offset[g] + i);
}

// The softmax of channel i's gates over its slots: its max and sum of exps;
// returns sum_j exp(Z_j - max) P_j.
float pool_channel(const Slots& s, const float* P, const float* Z, int64_t width, int64_t i, float& mx, float& sum) {
  mx = -std::numeric_limits<float>::infinity();
  for_slots(s, width, i, [&](int64_t k) { mx = std::max(mx, Z[k]); });
  sum = 0;
  float acc = 0;
  for_slots(s, width, i, [&](int64_t k) {
    const float e = std::exp(Z[k] - mx);
    sum += e;
    acc += e * P[k];
  });
  return acc;
}

}  // namespace

void compressor_pool_forward(float* out, const float* P, const float* Z, const CompressorDims& d) {
  check_dims(d);
  const int64_t B = d.entries(), D = d.dim, W = d.width();
  parallel_ranges(B, B * d.ratio * D >= (int64_t{1} << 14), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Slots s = slots(b, d);
      float* o = out + b * D;
      for (int64_t i = 0; i < D; ++i) {
        float mx, sum;
        o[i] = pool_channel(s, P, Z, W, i, mx, sum) / sum;
      }
    }
  });
}

void compressor_pool_backward(float* dP, float* dZ, const float* dout, const float* P, const float* Z,
                              const CompressorDims& d) {
  check_dims(d);
  const int64_t B = d.entries(), D = d.dim, W = d.width();
  // With overlap an entry's slots reach into the previous window, whose
  // first halves no other entry touches: entries write disjoint elements,
  // so they run in parallel.
  parallel_ranges(B, B * d.ratio * D >= (int64_t{1} << 14), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Slots s = slots(b, d);
      for (int64_t i = 0; i < D; ++i) {
        float mx, sum;
        const float c = pool_channel(s, P, Z, W, i, mx, sum) / sum, g_out = dout[b * D + i];
        // C = sum_j w_j P_j: dP_j = w_j dC, dZ_j = w_j (P_j - C) dC.
        for_slots(s, W, i, [&](int64_t k) {
          const float w = std::exp(Z[k] - mx) / sum;
          dP[k] += w * g_out;
          dZ[k] += w * (P[k] - c) * g_out;
        });
      }
    }
  });
}

}  // namespace ds::ops
