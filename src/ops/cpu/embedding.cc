// Embedding lookup and its scatter-add gradient (contract: ops/embedding.h).
#include "ops/embedding.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "ops/backend.h"

namespace ds::ops {
namespace {

// Every id is checked before anything is written, so a bad batch leaves the
// outputs as they were.
void check_ids(const int32_t* ids, int64_t tokens, int64_t vocab, const char* name) {
  for (int64_t t = 0; t < tokens; ++t)
    DS_CHECK(ids[t] >= 0 && ids[t] < vocab, "{}: token {} has id {} outside the vocabulary [0, {})", name, t, ids[t],
             vocab);
}

// Columns per backward work item: 256 floats are 1 KiB of each row.
constexpr int64_t kCols = 256;

}  // namespace

void cpu::embedding_forward(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab,
                            int64_t dim) {
  DS_CHECK(tokens >= 0 && vocab > 0 && dim > 0, "embedding: tokens={} vocab={} dim={}", tokens, vocab, dim);
  check_ids(ids, tokens, vocab, "embedding");
#pragma omp parallel for schedule(static) if (tokens * dim > 65536)
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(out + t * dim, table + static_cast<int64_t>(ids[t]) * dim, dim * sizeof(float));
}

// Threads split the columns, never the tokens: each element of dtable receives
// its contributions in token order whatever the thread count, so repeated ids
// sum bitwise-reproducibly without atomics or per-thread copies of the table.
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t tokens, int64_t vocab,
                        int64_t dim) {
  DS_CHECK(tokens >= 0 && vocab > 0 && dim > 0, "embedding_backward: tokens={} vocab={} dim={}", tokens, vocab, dim);
  check_ids(ids, tokens, vocab, "embedding_backward");
  const int64_t slices = (dim + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (tokens * dim > 65536)
  for (int64_t c = 0; c < slices; ++c) {
    const int64_t j0 = c * kCols, n = std::min(kCols, dim - j0);
    for (int64_t t = 0; t < tokens; ++t) {
      float* dst = dtable + static_cast<int64_t>(ids[t]) * dim + j0;  // [n] of row ids[t]
      const float* src = dout + t * dim + j0;
      for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace ds::ops
