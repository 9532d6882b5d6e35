// Scalar reference for ops/compressor.h: each entry's slots gathered into a
// list, then a softmax over it, channel by channel.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/compressor.h"

namespace ds::ref {

template <typename T>
std::vector<T> compressor_pool(const std::vector<T>& P, const std::vector<T>& Z, const ops::CompressorDims& d) {
  const int64_t B = d.entries(), D = d.dim, W = d.width(), m = d.ratio;
  std::vector<T> out(B * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < D; ++i) {
      std::vector<T> p, z;  // the slots' values and gate scores
      if (d.overlap && b > 0)
        for (int64_t j = (b - 1) * m; j < b * m; ++j) {
          p.push_back(P[j * W + i]);
          z.push_back(Z[j * W + i]);
        }
      for (int64_t j = b * m; j < (b + 1) * m; ++j) {
        p.push_back(P[j * W + (d.overlap ? D : 0) + i]);
        z.push_back(Z[j * W + (d.overlap ? D : 0) + i]);
      }
      T mx = z[0], sum = 0, acc = 0;
      for (T v : z) mx = v > mx ? v : mx;
      for (size_t k = 0; k < z.size(); ++k) {
        sum += std::exp(z[k] - mx);
        acc += std::exp(z[k] - mx) * p[k];
      }
      out[b * D + i] = acc / sum;
    }
  return out;
}

}  // namespace ds::ref
