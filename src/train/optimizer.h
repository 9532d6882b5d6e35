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
//
// FSDP: an AdamW may own only the flat elements [lo, hi) of the parameter
// buffer (its shard); it keeps moments for those alone and updates only them.
// m[i - lo] and v[i - lo] belong to flat element i, so a whole-tree view of
// the moments is FlatParams::wrap over m (unsharded) or over the moments
// gathered from every shard.
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
  float *param, *grad;  // the whole tensor
  int64_t offset;       // of the tensor in the flat buffer
  bool trainable, decay;
};

class AdamW {
 public:
  // Binds to params and grads (which must outlive it) and owns m and v of
  // the flat elements [lo, hi) (hi = -1: params.data.size(), the whole buffer).
  AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, model::FlatParams& params,
        model::FlatParams& grads, int64_t lo = 0, int64_t hi = -1);

  // The gradients of every tensor of the tree within [lo, hi), frozen ones
  // included (the gradient norm covers them all, as MaxText's does).
  std::vector<ops::GradSpan> grad_spans() const;
  // The parameters within [lo, hi).
  std::vector<ops::GradSpan> param_spans() const;
  // One update at rate lr of every trainable element in [lo, hi); count()
  // grows by one.
  void update(double lr);
  int64_t count() const { return count_; }
  void set_count(int64_t c) { count_ = c; }
  int64_t lo() const { return lo_; }
  int64_t hi() const { return hi_; }

  std::vector<float> m, v;  // [hi - lo]
  const std::vector<TensorSlot>& slots() const { return slots_; }

 private:
  // Calls f(slot, first, count): the part of the slot's tensor inside [lo, hi).
  template <typename F>
  void for_each_part(F&& f) const;

  ops::AdamWConfig base_;
  std::vector<TensorSlot> slots_;
  int64_t lo_ = 0, hi_ = 0;
  int64_t count_ = 0;
};

}  // namespace ds::train
