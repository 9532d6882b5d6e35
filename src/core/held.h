// A float32 tensor held from a forward to its backward (a training step's
// residuals): as float32, or as bf16 codes when every value already is a
// bf16 value (dtype=bfloat16 rounds the residual stream in the forward, as
// MaxText's bf16 activations are): half the bytes, the same values back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/buffer.h"

namespace ds {

class HeldFloats {
 public:
  // Keeps x[0, n): as bf16 codes when `bf16`, and then every x[i] must be a
  // bf16 value (an internal error otherwise: a lossy keep would change the
  // gradients without a word).
  void keep(const float* x, int64_t n, bool bf16);
  // The same from a buffer, which this takes (moved, in float32).
  void take(Buffer<float>&& b, bool bf16);
  // The values in float32: the held buffer itself, or widened into *scratch.
  const float* values(Buffer<float>& scratch) const;
  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  bool is_bf16() const { return !bf16_.empty(); }
  size_t bytes() const { return f32_.size() * sizeof(float) + bf16_.size() * sizeof(uint16_t); }
  void clear() { *this = HeldFloats{}; }

 private:
  Buffer<float> f32_;
  Buffer<uint16_t> bf16_;
  int64_t n_ = 0;
};

// A training step's kept residuals between the forward and the backward:
// hold_bf16 moves each non-empty buffers[i] into held[i] as bf16 codes
// (its values must be bf16 values), widen puts every held one back in
// float32 and empties held. The spans have one size.
void hold_bf16(std::span<Buffer<float>* const> buffers, std::span<HeldFloats> held);
void widen(std::span<Buffer<float>* const> buffers, std::span<HeldFloats> held);

}  // namespace ds
