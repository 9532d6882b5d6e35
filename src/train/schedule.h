// MaxText's learning-rate schedule (maxtext_utils): the rate for the update
// that follows `step` updates already applied (step counts from 0).
//
//   N = learning_rate_schedule_steps (or steps), W = int(N * warmup_steps_fraction),
//   lr_f = learning_rate_final_fraction * lr. Each piece sees s = step - its start.
//   warmup  s in [0, W):  lr * s / W              (the first update has rate 0)
//   cosine  C = N - W:    lr_f + (lr - lr_f) * (1 + cos(pi * s / (C - 1))) / 2
//                         (reaches lr_f exactly at step N - 1)
//   wsd     D = int(N * wsd_decay_steps_fraction): lr for N - W - D steps, then
//           linear  lr + (lr_f - lr) * min(s, D - 1) / (D - 1)   or
//           cosine  as above with C = D
//   step >= N: 0
// With learning_rate_final_fraction 1 and no warmup the rate is constant.
#pragma once

#include <cstdint>

#include "train/config.h"

namespace ds::train {

double learning_rate_at(const TrainConfig& cfg, int64_t step);

}  // namespace ds::train
