// fp8 quantization as qwix's fp8 rule does it for MaxText's
// `quantization: fp8_full` (the recipe a GPU run would use), simulated on
// the CPU: one scale per channel, dynamic, from the absolute maximum.
//
// A channel is a row of x (quantize_rows: the reduction runs over its
// columns) or a column (quantize_cols). Per channel:
//   scale = absmax / qmax, qmax = 448 (e4m3) or 57344 (e5m2); a scale below
//           sqrt(FLT_MIN) (an all-zero channel) becomes 1;
//   q     = fp8(clip(x / scale, -qmax, qmax)), rounded to nearest even.
// q is written as the fp8 values themselves (as float, exact); x = scale q
// approximately. With bf16 = true the arithmetic is bf16's, as MaxText's
// dtype=bfloat16 runs it: x rounded to bf16 first, the scale rounded to bf16,
// and x / scale rounded to bf16 before the fp8 cast.
// Where the rule comes from: qwix (google/qwix) qarray.calibrate /
// compute_scale_zero_point / quantize_with_scale_zero_point and
// numerics.convert_to; MaxText's fp8_full QtRule leaves tile_size unset and
// channelwise axes on, so the channels are every axis but the contracting
// one(s). README's precision row lists where the engine departs from it.
#pragma once

#include <cstdint>
#include <string_view>

#include "ops/matmul.h"

namespace ds::ops {

// MaxText's `quantization` for training: none, or fp8_full, where every
// linear layer over float32 weights (ops/linear.h) runs on fp8 operands:
// forward x and W in e4m3 (x per row, W per output feature), backward the
// incoming gradient in e5m2 after it takes the other operand's forward
// scale (per row of dy for dx, per output feature for dW), with float32
// sums over the fp8 values and the scales applied to each sum. Process-wide,
// like gemm_dtype() (ops/matmul.h), set by the trainer.
enum class Quantization { kNone, kFp8Full };
void set_quantization(Quantization q);
Quantization quantization();
// "" (none) or "fp8_full"; anything else throws ds::Error.
Quantization parse_quantization(std::string_view name);

class ScopedQuantization {
 public:
  explicit ScopedQuantization(Quantization q) : saved_(quantization()) { set_quantization(q); }
  ~ScopedQuantization() { set_quantization(saved_); }
  ScopedQuantization(const ScopedQuantization&) = delete;
  ScopedQuantization& operator=(const ScopedQuantization&) = delete;

 private:
  Quantization saved_;
};

// float32, unquantized products while alive, whatever the run's dtype and
// quantization: the router and the indexers, whose outputs are discrete
// choices.
class ScopedFloat32Products {
 private:
  ScopedGemmDtype dtype_{GemmDtype::kF32};
  ScopedQuantization quantization_{Quantization::kNone};
};

enum class Fp8Kind { kE4m3, kE5m2 };

float fp8_max(Fp8Kind k);  // 448 or 57344
// x rounded to the nearest fp8 value of kind k (ties to even), saturating:
// |x| beyond the largest finite value gives that value (as after the clip).
float fp8_round(float x, Fp8Kind k);

// Rows of x [rows, cols] (leading dimension ld) -> q [rows, cols] (compact)
// and scale [rows].
void fp8_quantize_rows(float* q, float* scale, const float* x, int64_t rows, int64_t cols, int64_t ld, Fp8Kind kind,
                       bool bf16);
// Columns of x [rows, cols] (leading dimension ld) -> q [rows, cols] (compact)
// and scale [cols].
void fp8_quantize_cols(float* q, float* scale, const float* x, int64_t rows, int64_t cols, int64_t ld, Fp8Kind kind,
                       bool bf16);

}  // namespace ds::ops
