// Top-k and the sort-by-expert permutation (math and gradients: ops/routing.h).
//
// top-k scans each row once, keeping the k best so far in a small sorted buffer
// (k is 6-8 experts, or a sampler's few dozen candidates): an element that
// does not beat the current k-th value costs one comparison. Large k falls
// back to a partial sort. NaN has no place in a descending order, and a NaN
// router score means training has already diverged, so a NaN anywhere in a row
// is an error rather than a silently arbitrary choice.
//
// route_indices is a counting sort: stable by construction, O(n + experts),
// and sequential, so order / inverse never depend on the thread count. The
// gathers are parallel over destination rows; route_backward sums a token's k
// contributions in j order, which keeps it deterministic without atomics.
#include "ops/routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {
namespace {

// Above this k an insertion buffer costs more than a partial sort of the row.
constexpr int64_t kInsertionMaxK = 32;

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 15;

// k largest of v[0..n) (no NaN), descending, ties to the lower index. The
// buffer (vals, idx)[0..filled) is kept sorted; scanning in index order means an
// element equal to a buffered one goes after it, so only a strictly larger
// value displaces anything.
void topk_insertion(int32_t* idx, float* vals, const float* v, int64_t n, int64_t k) {
  int64_t filled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (filled == k && !(x > vals[k - 1])) continue;
    int64_t p = filled < k ? filled++ : k - 1;  // the slot freed at the end
    while (p > 0 && vals[p - 1] < x) {
      vals[p] = vals[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    vals[p] = x;
    idx[p] = static_cast<int32_t>(i);
  }
}

void topk_partial_sort(int32_t* idx, float* vals, const float* v, int64_t n, int64_t k, std::vector<int32_t>& perm) {
  perm.resize(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::partial_sort(perm.begin(), perm.begin() + k, perm.end(),
                    [v](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = perm[j];
    vals[j] = v[perm[j]];
  }
}

// Whether v[0..n) holds a NaN; v != v is the NaN test that vectorizes.
bool has_nan(const float* v, int64_t n) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= v[i] != v[i];
  return any;
}

// out[r] = src[idx[r] / div] for r < rows; idx must lie in [0, src_rows * div).
void gather_rows(float* out, const float* src, const int32_t* idx, int64_t rows, int64_t div, int64_t src_rows,
                 int64_t dim, const char* what) {
  const int64_t limit = src_rows * div;
  for (int64_t r = 0; r < rows; ++r)
    DS_CHECK(idx[r] >= 0 && idx[r] < limit, "{}: index {} at row {} outside [0, {})", what, idx[r], r, limit);
  parallel_ranges(rows, rows * dim >= kMinParallelWork, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(out + r * dim, src + static_cast<int64_t>(idx[r]) / div * dim, dim * sizeof(float));
  });
}

}  // namespace

void topk(int32_t* indices, float* values, const float* x, int64_t rows, int64_t cols, int64_t k) {
  DS_CHECK(rows >= 0 && cols >= 1 && cols <= std::numeric_limits<int32_t>::max(), "topk: rows={} cols={}", rows, cols);
  DS_CHECK(k >= 1 && k <= cols, "topk: k={} must be in [1, cols={}]", k, cols);
  // The NaN check comes first so that the selection below may assume a total order.
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  int64_t nan_row = kNone;
#pragma omp parallel for schedule(static) reduction(min : nan_row) if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    if (has_nan(x + r * cols, cols)) nan_row = std::min(nan_row, r);
  if (nan_row != kNone) {
    const float* row = x + nan_row * cols;
    const int64_t col = std::find_if(row, row + cols, [](float v) { return std::isnan(v); }) - row;
    DS_FAIL("topk: NaN at row {} column {} of [{}, {}]", nan_row, col, rows, cols);
  }
#pragma omp parallel if (rows * cols >= kMinParallelWork)
  {
    std::vector<int32_t> perm;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (k <= kInsertionMaxK)
        topk_insertion(indices + r * k, values + r * k, x + r * cols, cols, k);
      else
        topk_partial_sort(indices + r * k, values + r * k, x + r * cols, cols, k, perm);
    }
  }
}

void route_indices(int32_t* order, int32_t* inverse, int32_t* group_sizes, const int32_t* experts, int64_t n,
                   int64_t num_experts) {
  DS_CHECK(n >= 0 && n <= std::numeric_limits<int32_t>::max(), "route_indices: n={} assignments", n);
  DS_CHECK(num_experts >= 1 && num_experts <= std::numeric_limits<int32_t>::max(), "route_indices: num_experts={}",
           num_experts);
  std::fill(group_sizes, group_sizes + num_experts, 0);
  for (int64_t a = 0; a < n; ++a) {
    DS_CHECK(experts[a] >= 0 && experts[a] < num_experts,
             "route_indices: expert id {} of assignment {} outside [0, {})", experts[a], a, num_experts);
    ++group_sizes[experts[a]];
  }
  // Start row of each expert, then one stable pass in assignment order.
  std::vector<int64_t> next(num_experts);
  int64_t offset = 0;
  for (int64_t g = 0; g < num_experts; ++g) {
    next[g] = offset;
    offset += group_sizes[g];
  }
  for (int64_t a = 0; a < n; ++a) {
    const int64_t r = next[experts[a]]++;
    order[r] = static_cast<int32_t>(a);
    inverse[a] = static_cast<int32_t>(r);
  }
}

void route_forward(float* out, const float* x, const int32_t* order, int64_t tokens, int64_t k, int64_t dim) {
  DS_CHECK(tokens >= 0 && k >= 1 && dim >= 1, "route_forward: tokens={} k={} dim={}", tokens, k, dim);
  gather_rows(out, x, order, tokens * k, k, tokens, dim, "route_forward");
}

void route_backward(float* dx, const float* dout, const int32_t* inverse, int64_t tokens, int64_t k, int64_t dim) {
  DS_CHECK(tokens >= 0 && k >= 1 && dim >= 1, "route_backward: tokens={} k={} dim={}", tokens, k, dim);
  const int64_t n = tokens * k;
  for (int64_t a = 0; a < n; ++a)
    DS_CHECK(inverse[a] >= 0 && inverse[a] < n, "route_backward: inverse[{}]={} outside [0, {})", a, inverse[a], n);
#pragma omp parallel for schedule(static) if (n * dim >= kMinParallelWork)
  for (int64_t t = 0; t < tokens; ++t) {
    float* d = dx + t * dim;  // [dim]
    std::memcpy(d, dout + static_cast<int64_t>(inverse[t * k]) * dim, dim * sizeof(float));
    for (int64_t j = 1; j < k; ++j) {
      const float* s = dout + static_cast<int64_t>(inverse[t * k + j]) * dim;
      for (int64_t c = 0; c < dim; ++c) d[c] += s[c];
    }
  }
}

void unroute_forward(float* out, const float* y, const int32_t* inverse, int64_t n, int64_t dim) {
  DS_CHECK(n >= 0 && dim >= 1, "unroute_forward: n={} dim={}", n, dim);
  gather_rows(out, y, inverse, n, 1, n, dim, "unroute_forward");
}

void unroute_backward(float* dy, const float* dout, const int32_t* order, int64_t n, int64_t dim) {
  DS_CHECK(n >= 0 && dim >= 1, "unroute_backward: n={} dim={}", n, dim);
  gather_rows(dy, dout, order, n, 1, n, dim, "unroute_backward");
}

}  // namespace ds::ops
