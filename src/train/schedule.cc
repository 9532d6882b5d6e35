#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace ds::train {

namespace {

// Cosine from lr to lr_f over C steps (s in [0, C)); a one-step piece is lr.
double cosine(double lr, double lr_f, int64_t s, int64_t C) {
  if (C <= 1) return lr;
  const double p = static_cast<double>(s) / static_cast<double>(C - 1);
  return lr_f + (lr - lr_f) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace

double learning_rate_at(const TrainConfig& c, int64_t step) {
  const int64_t N = c.schedule_steps();
  if (step < 0 || step >= N) return 0.0;
  const double lr = c.learning_rate, lr_f = c.learning_rate_final_fraction * lr;
  const auto W = static_cast<int64_t>(static_cast<double>(N) * c.warmup_steps_fraction);
  if (step < W) return lr * static_cast<double>(step) / static_cast<double>(W);
  const int64_t s = step - W;
  if (c.lr_schedule_type == "cosine") return cosine(lr, lr_f, s, N - W);
  // wsd
  const auto D = static_cast<int64_t>(static_cast<double>(N) * c.wsd_decay_steps_fraction);
  const int64_t stable = N - W - D;
  if (s < stable) return lr;
  const int64_t d = s - stable;
  if (c.wsd_decay_style == "cosine") return cosine(lr, lr_f, d, D);
  if (D <= 1) return lr_f;
  return lr + (lr_f - lr) * static_cast<double>(std::min(d, D - 1)) / static_cast<double>(D - 1);
}

}  // namespace ds::train
