// Linear layers over weights kept in the checkpoint's own dtype.
//
//   y[M, out] = x[M, in] @ W[out, in]^T        (Hugging Face Linear layout)
//
// W may be float32, bf16, f16, or fp8 (e4m3/e5m2) with per-block float32
// `scale_inv` of shape [ceil(out/br), ceil(in/bc)] (DeepSeek-V3: 128x128
// blocks, partial blocks at the edges): W[r, c] = fp8[r, c] * s[r/br, c/bc],
// or packed fp4 (f4_e2m1: two codes a byte, element 2j of a row in the low
// nibble of its byte j) with one e8m0 scale byte per 32 elements of a row in
// `scale_e8m0` [out, in/32] (DeepSeek-V4's MXFP4 experts; in a multiple of
// 32): W[r, c] = e2m1(code[r, c]) * 2^(e[r, c/32] - 127).
// Narrow weights are widened to float32 inside the kernels, so a model never
// needs a float32 copy of its weights. The kernels are SIMD code for every
// CPU (ops/cpu/linear.cc): for decode-sized M, dot products over blocks of
// rows that widen bf16, block-scaled e4m3 and fp4 in registers (other dtypes a row
// at a time); for larger M, an outer-product kernel over x packed transposed
// that broadcasts bf16 weights in place and other dtypes from a widened
// chunk of rows. float32 weights go to ops::gemm.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"

namespace ds::ops {

struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0;  // out features
  int64_t cols = 0;  // in features
  const float* scale_inv = nullptr;  // fp8 only
  int64_t block_rows = 128, block_cols = 128;
  const uint8_t* scale_e8m0 = nullptr;  // f4_e2m1 only: [rows, cols / 32]
};

// Rows [r0, r1) of W as a weight of its own. For fp8, r0 must be a multiple
// of block_rows (the scales are indexed by block); fp4 has a scale row per row.
WeightView row_slice(const WeightView& w, int64_t r0, int64_t r1);

// Widens rows [r0, r1) of W into out[(r1 - r0), cols] (float32, dequantized).
void widen_rows(float* out, const WeightView& w, int64_t r0, int64_t r1);

// The precision of linear_forward over narrow (non-float32) weights:
//   kF32   x as it is, float32 products and sums (the default);
//   kBf16  x rounded to the nearest bf16 first, float32 sums: a bf16 matmul
//          as PyTorch's autocast, JAX's default precision or llama.cpp's bf16
//          weights run it. Where the CPU has AVX512-BF16 (and core/simd.h's cap
//          allows it) products over bf16, fp4 or block-scaled e4m3 weights
//          with more than 8 rows of x run on its dot-product instruction, at
//          twice the FMA rate; its sums take two products at a time and treat
//          subnormal inputs as zero, and e4m3 weights are scaled per block of
//          sums rather than per element. Elsewhere the float32 kernels multiply
//          the rounded x.
// Float32 weights without block scales (training's) always run in float32.
// Process-wide, set once by the program (`deepseek --matmul-precision`)
// before it runs a model.
enum class MatmulPrecision { kF32, kBf16 };
void set_matmul_precision(MatmulPrecision p);
MatmulPrecision matmul_precision();
// "f32"/"float32" or "bf16"/"bfloat16"; anything else is an error.
MatmulPrecision parse_matmul_precision(std::string_view name);
std::string_view matmul_precision_name(MatmulPrecision p);
// The x of decode-sized products (8 rows of x or fewer) over q4_k, q6_k and
// q8_0 weights:
//   kInt8  rounded to 8 bits a block of 256 for q4_k and q6_k, of 32 for q8_0
//          (nearest of x / dx, dx = the block's max |x| / 127), the codes
//          multiplied as integers, exact 32-bit sums within a block
//          (llama.cpp's q8_K x q4_K, q8_K x q6_K and q8_0 x q8_0); the default: the
//          decode step's largest cost is these products;
//   kF32   x as it is, float32 products and sums (exactly what the
//          dequantized weights compute, up to the order of sums).
// Process-wide, set once by the program (`deepseek --quantized-x`).
enum class QuantizedX { kInt8, kF32 };
void set_quantized_x(QuantizedX q);
QuantizedX quantized_x();
// "int8" or "f32"/"float32"; anything else is an error.
QuantizedX parse_quantized_x(std::string_view name);
// Whether bf16-precision prefill products over bf16, fp4 and block-scaled
// e4m3 weights run on bf16 dot-product instructions here (the dispatched
// target, the CPU and the cap).
bool bf16_dot_products();

// y = x W^T; x [M, in] row-major with row stride ldx, y [M, out] with row
// stride ldy. With accumulate, y += x W^T.
void linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                    bool accumulate = false);
inline void linear_forward(float* y, const float* x, const WeightView& w, int64_t M) {
  linear_forward(y, x, w, M, w.cols, w.rows);
}
// y0 = x W0^T and y1 = x W1^T (rows w0.rows and w1.rows apart) over the same
// x [M, cols] (a gated MLP's gate and up): the same bits as two
// linear_forward calls, with x packed once for both where the prefill kernels
// run (M > 8, narrow weights of one dtype).
void linear_forward_pair(float* y0, const WeightView& w0, float* y1, const WeightView& w1, const float* x,
                         int64_t M);

// Backward of linear_forward for float32 weights (training):
//   dx = dy W   (`=`, or `+=` with accumulate_dx; dx may be null)
//   dW += dy^T x   (dw may be null)
// dy [M, out] row stride ldy, x and dx [M, in] row stride ldx. Deterministic:
// ops::gemm never splits a reduction.
void linear_backward(float* dx, float* dw, const float* dy, const float* x, const WeightView& w, int64_t M,
                     int64_t ldx, int64_t ldy, bool accumulate_dx = false);
inline void linear_backward(float* dx, float* dw, const float* dy, const float* x, const WeightView& w, int64_t M,
                            bool accumulate_dx = false) {
  linear_backward(dx, dw, dy, x, w, M, w.cols, w.rows, accumulate_dx);
}

// Block quantization to fp8 e4m3 as DeepSeek-V3 checkpoints store it:
// scale_inv[b] = amax(block b) / 448 (1 for an all-zero block), q = w / scale_inv.
void quantize_fp8_blocks(uint8_t* q, float* scale_inv, const float* w, int64_t rows, int64_t cols,
                         int64_t block_rows = 128, int64_t block_cols = 128);

}  // namespace ds::ops
