// AdamW over the model's float32 parameter tree, with MaxText's masks.
//
// Per tensor (from the parameter tree's ParamInfo and the config's regexes,
// each searched in the Hugging Face name):
//   trainable  not the routing bias (it moves only by the balancing rule),
//              and, when trainable_parameters_mask is non-empty, matching
//              one of its regexes; others keep their value and get no update
//              and no weight decay (optax's set_to_zero partition);
//   decay      a matrix (two or more dimensions: embedding, projections,
//              experts, router, LM head; never norm scales) not matched by
//              adamw_mask.
// The step is ops::adamw_update (m and v start at 0, bias-corrected, eps_root
// inside the square root) with the rate of the schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "ops/adamw.h"
#include "train/config.h"

namespace ds::train {

struct TensorSlot {
  model::ParamInfo info;
  float *param, *grad, *m, *v;
  bool trainable, decay;
};

class AdamW {
 public:
  // Binds to params and grads (which must outlive it) and owns m and v.
  AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, model::FlatParams& params,
        model::FlatParams& grads);

  // Every tensor of the tree, frozen ones included (the gradient norm covers
  // them all, as MaxText's does).
  std::vector<ops::GradSpan> grad_spans() const;
  // One update at rate lr of every trainable tensor; count() grows by one.
  void update(double lr);
  int64_t count() const { return count_; }
  void set_count(int64_t c) { count_ = c; }

  model::FlatParams m, v;
  const std::vector<TensorSlot>& slots() const { return slots_; }

 private:
  ops::AdamWConfig base_;
  std::vector<TensorSlot> slots_;
  int64_t count_ = 0;
};

}  // namespace ds::train
