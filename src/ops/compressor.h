// DeepSeek-V4's compressor pooling: the gated pooling that turns every m
// tokens' projections into one compressed key/value entry (m = 4 on the
// compressed sparse attention layers and for their indexer keys, m = 128 on
// the heavily compressed ones). Per channel i of entry b:
//
//   plain:    C_b,i = sum over the m tokens j of window b of
//                     softmax_j(Z_j,i) P_j,i                  P, Z [T, Dc]
//   overlap:  the softmax runs over 2m slots: the previous window's tokens
//             with their first-half channels (P_j,i, Z_j,i) and this
//             window's with their second half (P_j,Dc+i, Z_j,Dc+i); for
//             b = 0 the previous window's slots are absent.   P, Z [T, 2 Dc]
//
// P is the tokens' wkv projection, Z their wgate projection plus the
// position embedding ape[t mod m] (the caller's). Only whole windows make
// entries: floor(T / m). The RMSNorm, rotary embedding and quantization that
// follow are separate ops.
#pragma once

#include <cstdint>

namespace ds::ops {

struct CompressorDims {
  int64_t tokens = 0;
  int64_t dim = 0;    // Dc, the entry width
  int64_t ratio = 4;  // m
  bool overlap = false;
  int64_t entries() const { return ratio > 0 ? tokens / ratio : 0; }
  int64_t width() const { return (overlap ? 2 : 1) * dim; }  // of P and Z
};

// out [entries, Dc] from P, Z [tokens, width].
void compressor_pool_forward(float* out, const float* P, const float* Z, const CompressorDims& dims);

// dP, dZ [tokens, width] += the gradients given dout [entries, Dc]. Tokens
// past the last whole window get none.
void compressor_pool_backward(float* dP, float* dZ, const float* dout, const float* P, const float* Z,
                              const CompressorDims& dims);

}  // namespace ds::ops
