// Threading. Kernels use OpenMP directly; these helpers set and read the
// thread count and give training reductions a partition that does not depend on
// it, so results are bitwise identical for any number of threads.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

namespace ds {

int num_threads();
void set_num_threads(int n);

// Fixed block size for deterministic reductions: a reduction over n items is
// split into ceil(n / kReduceBlock) blocks, each summed sequentially, and the
// block partials are then summed in block order. The thread count only decides
// which thread computes which block.
inline constexpr int64_t kReduceBlock = 64;
inline int64_t reduce_blocks(int64_t n) { return (n + kReduceBlock - 1) / kReduceBlock; }

// Runs f(begin, end) over [0, n): split evenly over a thread team when
// `parallel` holds and no team is active yet, else once on the calling
// thread. Use it instead of `#pragma omp parallel if (...)` on hot paths: a
// region whose if-clause is false still builds a one-thread team and ends
// with a futex call, which on a decode step (hundreds of tiny regions) costs
// more than the work. f must give the same result for any split.
template <typename F>
void parallel_ranges(int64_t n, bool parallel, F&& f) {
  if (n <= 0) return;
  if (!parallel || n == 1 || omp_in_parallel() || omp_get_max_threads() == 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t b = n * id / nt, e = n * (id + 1) / nt;
    if (b < e) f(b, e);
  }
}

// y[i] = a[i] + b[i] for i < n (y may be a or b), split over the threads
// from a few thousand elements: a layer's residual adds, which on one thread
// leave the others waiting.
inline void parallel_add(float* y, const float* a, const float* b, int64_t n) {
  parallel_ranges(n, n >= (int64_t{1} << 14), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] + b[i];
  });
}

// p[0, n) = 0, split over the threads when n is large: a memset of a few
// MiB on one thread leaves the others waiting.
inline void parallel_zero(float* p, int64_t n) {
  parallel_ranges(n, n >= (int64_t{1} << 18),
                  [&](int64_t b, int64_t e) { std::memset(p + b, 0, static_cast<size_t>(e - b) * sizeof(float)); });
}

// Runs f(t) for every t in [0, n) as tasks that the threads take one at a
// time (the largest first, if the caller orders them so), or in order on the
// calling thread when `parallel` is false or a team is already active. f must
// give the same result whichever thread runs it. A task's exception is
// rethrown here once every task has ended (the lowest task's, if several).
template <typename F>
void parallel_tasks(int64_t n, bool parallel, F&& f) {
  if (n <= 0) return;
  if (!parallel || n == 1 || omp_in_parallel() || omp_get_max_threads() == 1) {
    for (int64_t t = 0; t < n; ++t) f(t);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < n; ++t) {
    try {
      f(t);
    } catch (...) {
      errors[static_cast<size_t>(t)] = std::current_exception();
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace ds
