// Block-quantized weight rows: q8_0 and q4_k (core/dtype.h), laid out byte
// for byte as ggml lays them out, so a row quantized here is a row of a GGUF
// file and the other way round.
//
//   q8_0  blocks of 32 values, 34 bytes: f16 d, then 32 int8 q; x = d q.
//         d = max |x| / 127, q = x / d rounded half away from zero (ggml's
//         rule: the same bytes as llama-quantize), d stored as f16.
//   q4_k  blocks of 256 values, 144 bytes: f16 d, f16 dmin, 12 bytes holding
//         8 six-bit scales sc and 8 six-bit mins m (one pair per sub-block
//         of 32 values), then 128 bytes of 4-bit codes: byte l of chunk c
//         (32 bytes) holds value 64c + l in its low nibble and 64c + 32 + l
//         in its high one. x = d sc_j q - dmin m_j for a value of sub-block j.
//   q4_1  blocks of 32 values, 20 bytes: f16 d, f16 m, 16 bytes of 4-bit
//         codes (value l in the low nibble of byte l, value 16 + l in the
//         high one); x = d q + m. For rows that are not whole blocks of 256.
//
// The q4_k and q4_1 quantizers fit each sub-block (block) by weighted least squares over a
// sweep of candidate scales (weights |x| plus the sub-block's RMS, so large
// values count more and none counts nothing), keeps the best fit with a
// non-negative offset, then rounds the eight scales and mins to six bits
// under the block's d and dmin and quantizes the values again under the
// rounded scales. A row's length must be a multiple of the block
// (fits_block_format); callers keep a wider format otherwise.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace ds::ops {

inline constexpr int64_t kQ8_0Values = 32, kQ8_0Bytes = 34;
inline constexpr int64_t kQ4_KValues = 256, kQ4_KBytes = 144;
inline constexpr int64_t kQ4_KSubBlock = 32;
inline constexpr int64_t kQ4_1Values = 32, kQ4_1Bytes = 20;

bool is_block_format(DType t);
int64_t block_values(DType t);  // values a block (32 or 256)
int64_t block_bytes(DType t);   // bytes a block (34, 144 or 20)
// Whether a row of `cols` values is whole blocks of t.
bool fits_block_format(DType t, int64_t cols);
// Bytes of a row of `cols` values (whole blocks).
int64_t block_row_bytes(DType t, int64_t cols);

// n values (whole blocks) of x into blocks of t at out. ds::Error for a
// value that is not finite or a block whose scale f16 cannot hold.
void quantize_blocks(DType t, const float* x, int64_t n, uint8_t* out);
// Every row of x [rows, cols] into out (rows of block_row_bytes), the
// threads splitting the rows.
void quantize_rows(DType t, const float* x, int64_t rows, int64_t cols, uint8_t* out);
// n values (whole blocks) back to float32: ggml's own reading
// (io/gguf_quants.h, the plain loops the kernels in ops/cpu/ are checked
// against).
void dequantize_blocks(DType t, const uint8_t* blocks, int64_t n, float* out);

// The first block among the n values at `blocks` whose f16 scale (or
// offset) is not finite, or -1: blocks read from a file are checked once.
int64_t blocks_not_finite(DType t, const uint8_t* blocks, int64_t n);

}  // namespace ds::ops
