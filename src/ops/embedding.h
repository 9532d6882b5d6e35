// Embedding lookup: out[t] = table[ids[t]]  (ids checked against vocab).
// Backward scatters: dtable[ids[t]] += dout[t]  (weight gradient: `+=`),
// deterministic: each thread owns a slice of the columns and walks the tokens
// in order, so repeated ids accumulate in the same order for any thread count.
#pragma once

#include <cstdint>

namespace ds::ops {

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab,
                       int64_t dim);
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t tokens, int64_t vocab,
                        int64_t dim);

}  // namespace ds::ops
