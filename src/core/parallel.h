// Threading. Kernels use OpenMP directly; these helpers set and read the
// thread count and give training reductions a partition that does not depend on
// it, so results are bitwise identical for any number of threads.
#pragma once

#include <cstdint>

namespace ds {

int num_threads();
void set_num_threads(int n);

// Fixed block size for deterministic reductions: a reduction over n items is
// split into ceil(n / kReduceBlock) blocks, each summed sequentially, and the
// block partials are then summed in block order. The thread count only decides
// which thread computes which block.
inline constexpr int64_t kReduceBlock = 64;
inline int64_t reduce_blocks(int64_t n) { return (n + kReduceBlock - 1) / kReduceBlock; }

}  // namespace ds
