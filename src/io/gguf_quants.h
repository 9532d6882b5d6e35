// ggml's block formats read back to float32, as ggml dequantizes them
// (ggml-quants.c's dequantize_row_*): F32, F16, BF16, and the blocks
//   Q4_0  32 values: f16 d, 16 bytes of nibbles; x = d (q - 8), the low
//         nibbles values 0..15, the high ones 16..31
//   Q4_1  32 values: f16 d, f16 m, 16 bytes of nibbles; x = d q + m
//   Q5_0  32 values: f16 d, 4 bytes of fifth bits, 16 of nibbles;
//         x = d (q - 16)
//   Q5_1  32 values: f16 d, f16 m, 4 bytes of fifth bits, 16 of nibbles;
//         x = d q + m
//   Q8_0  32 values: f16 d, 32 int8; x = d q
//   Q4_K  256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of
//         8 sub-blocks of 32, 128 bytes of nibbles; x = d sc q - dmin m
//   Q6_K  256 values: 128 bytes of low nibbles, 64 of high 2-bit pairs,
//         16 int8 scales of sub-blocks of 16, f16 d; x = d sc (q - 32)
#pragma once

#include <cstdint>

#include "io/gguf.h"

namespace ds::io::gguf {

// Whether dequantize() reads type t.
bool can_dequantize(TensorType t);

// n values (a multiple of t's block) from `src` into `dst`.
void dequantize(TensorType t, const uint8_t* src, int64_t n, float* dst);

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
inline void q4_k_scale_min(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace ds::io::gguf
