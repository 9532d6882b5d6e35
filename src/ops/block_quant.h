// Block-quantized weight rows: q8_0, q4_k, q4_1 and q6_k (core/dtype.h), laid out byte
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
//   q6_k  blocks of 256 values, 210 bytes: 128 bytes of the codes' low 4
//         bits (ql), 64 of their high 2 bits (qh), 16 int8 scales sc (one
//         per 16 values), f16 d; x = d sc_j (q - 32), q in [0, 63]. In each
//         half of 128 values, l < 32: value l is ql[l] low | qh[l] bits 0-1,
//         32 + l is ql[32 + l] low | qh[l] bits 2-3, 64 + l is ql[l] high |
//         bits 4-5, 96 + l is ql[32 + l] high | bits 6-7 (ggml's Q6_K, which
//         publishers' Q4_K_M files keep for some matrices). Its quantizer
//         is the plain one: a group's scale maps its value of largest
//         magnitude to q - 32 = -32, d = the largest |scale| / 127, the
//         scales rounded up to int8 under d and the values to the nearest
//         q under them (each value within one step d |sc_j|, most within
//         half of it).
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
inline constexpr int64_t kQ6_KValues = 256, kQ6_KBytes = 210;
// Every block format, in the order a row's byte count is matched against.
inline constexpr DType kBlockFormats[] = {DType::Q8_0, DType::Q4_K, DType::Q4_1, DType::Q6_K};

bool is_block_format(DType t);
int64_t block_values(DType t);  // values a block (32 or 256)
int64_t block_bytes(DType t);   // bytes a block (34, 144, 20 or 210)
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

namespace detail {
// The q4_k / q4_1 fit's sweep: kQ4SweepSteps candidate scales
// (15 + 0.1 (k - kQ4SweepFirst)) / range for k < kQ4SweepSteps, range the
// sub-block's max - min. For each, with q_i = min(trunc(iscale xl_i + 0.5), 15)
// the codes of xl_i = x_i - min over the sub-block's kQ4_KSubBlock values,
// sums[k], sums[kQ4SweepPad + k], sums[2 kQ4SweepPad + k] = sum w_i q_i,
// sum w_i q_i^2, sum w_i q_i x_i (xd_i = x_i), each summed as four
// partials (value i into partial i mod 4, in order) then
// (p0 + p1) + (p2 + p3); the pad entries are 0.
inline constexpr int kQ4SweepSteps = 22, kQ4SweepFirst = 9, kQ4SweepPad = 24;
void q4_sweep_sums(const float* xl, const double* w, const double* xd, float range, double* sums);
// Then each candidate's fit x ~ a q + c by weighted least squares (sw, swx,
// swxx: the sums of w, w x, w x^2), c = 0 and a = swqx / swqq where c > 0
// and !any_offset, and its weighted squared error e, +inf where the fit is
// not one (det <= 0 or a <= 0): fits[k], fits[kQ4SweepPad + k],
// fits[2 kQ4SweepPad + k] = a, c, e.
void q4_sweep_fits(const double* sums, double sw, double swx, double swxx, bool any_offset, double* fits);
// A sub-block's codes under scale a > 0 and offset b: q_i =
// clamp(nearbyint((x_i + b) / a), 0, 15), for kQ4_KSubBlock values.
void q4_codes(const float* x, float a, float b, uint8_t* q);
// q8_0 blocks of `blocks` x 32 values (whole blocks: quantize_blocks' rule
// for q8_0); q8_0_put_scale stores a block's d as its f16 (ds::Error where
// f16 cannot hold it).
void q8_0_blocks(const float* x, int64_t blocks, uint8_t* out);
void q8_0_put_scale(uint8_t* out, float d);
// The SIMD kernels above (ops/cpu/block_quant_simd.cc) are checked
// against these plain loops: the same bits.
void q8_0_blocks_plain(const float* x, int64_t blocks, uint8_t* out);
void q4_sweep_sums_plain(const float* xl, const double* w, const double* xd, float range, double* sums);
void q4_sweep_fits_plain(const double* sums, double sw, double swx, double swxx, bool any_offset, double* fits);
}  // namespace detail

}  // namespace ds::ops
