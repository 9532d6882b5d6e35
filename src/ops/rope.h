// Rotary position embedding with YaRN frequency scaling, as DeepSeek-V3 uses it.
//
// Frequencies (dim = rotary dimension, i in [0, dim/2)):
//   f_i = theta^(-2i/dim)
//   low  = max(floor(dim * ln(orig_max / (beta_fast * 2 pi)) / (2 ln theta)), 0)
//   high = min(ceil (dim * ln(orig_max / (beta_slow * 2 pi)) / (2 ln theta)), dim - 1)
//   smooth_i = 1 - clamp((i - low) / (high - low or 0.001 if equal), 0, 1)
//   f_i' = f_i / factor * (1 - smooth_i) + f_i * smooth_i
// With factor == 1 (no rope_scaling) the blend leaves f_i unchanged.
// The angle of pair i at position p is p * f_i' (float32), with no magnitude
// scaling of cos/sin (the mscale correction belongs to the softmax scale).
//
// Layouts: Interleaved rotates pairs (x[2i], x[2i+1]) (MLA's q_pe and k_pe, as
// Hugging Face DeepSeek weights are stored); HalfSplit rotates (x[i],
// x[i + dim/2]) (the DeepSeek-V3.2 indexer).
//   y_a = x_a cos - x_b sin,  y_b = x_b cos + x_a sin
// Backward is the inverse rotation (rotation by -angle): dx = R^T dy (`=`).
#pragma once

#include <cstdint>

namespace ds::ops {

struct RopeConfig {
  int64_t dim = 64;                // rotary dimension (even)
  double theta = 10000.0;          // rope_theta
  double factor = 1.0;             // rope_factor (YaRN scaling factor; 1 = plain RoPE)
  int64_t original_max_position = 4096;  // original_max_position_embeddings
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

enum class RopeLayout { Interleaved, HalfSplit };

// freqs [dim/2]: the YaRN-corrected inverse frequencies f_i'.
void rope_frequencies(float* freqs, const RopeConfig& cfg);

// x, y: [tokens, heads, dim] addressed with element strides (token_stride,
// head_stride) and unit stride inside a head; positions [tokens]. y may alias x
// (same strides are used for both).
void rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens,
                  int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout);
void rope_backward(float* dx, const float* dy, const int32_t* positions, const float* freqs, int64_t tokens,
                   int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout);

}  // namespace ds::ops
