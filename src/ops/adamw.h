// AdamW (Loshchilov & Hutter) with bias correction and decoupled weight decay,
// and global gradient-norm clipping.
//
// step t (1-based):
//   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
//   p -= lr * ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t) + eps_root) + eps) + wd * p )
// (optax's adamw with eps_root; PyTorch's AdamW is eps_root = 0).
// Clipping: norm = sqrt(sum over all tensors of sum g^2) (double accumulation,
// fixed block order: bitwise the same for any thread count); if norm > max_norm
// every gradient is scaled by max_norm / norm (optax's clip_by_global_norm,
// which MaxText's gradient_clipping_threshold applies).
#pragma once

#include <cstdint>
#include <vector>

namespace ds::ops {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float eps_root = 0.0f;
  float weight_decay = 0.1f;
};

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWConfig& cfg,
                  int64_t step);

struct GradSpan {
  float* data;
  int64_t n;
};

// Returns the global L2 norm of all gradients.
double global_grad_norm(const std::vector<GradSpan>& grads);
// Multiplies every gradient by s.
void scale_grads(const std::vector<GradSpan>& grads, float s);
// Scales the gradients so their global norm is at most max_norm; returns the
// norm before clipping.
double clip_grad_norm(const std::vector<GradSpan>& grads, double max_norm);

}  // namespace ds::ops
