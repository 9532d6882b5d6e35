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
// FSDP: an AdamW may own only some runs of the flat parameter order (its
// shards, stored wherever the caller keeps them); it keeps moments for those
// elements alone, in the order of the runs, and updates only them. Over the
// whole buffer m[i] and v[i] belong to flat element i, so FlatParams::wrap
// over m is the moments' tree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "ops/adamw.h"
#include "train/config.h"

namespace ds::train {

// Flat elements [lo, hi) of the parameter order, whose values live at
// param[i - lo] and gradients at grad[i - lo].
struct OwnedRange {
  int64_t lo, hi;
  float *param, *grad;
};

struct TensorSlot {
  model::ParamInfo info;
  int64_t offset;  // of the tensor in the flat order
  bool trainable, decay;
};

class AdamW {
 public:
  // The tensors of `layout`, in order, make up the flat parameter order
  // (any model family). Owns m and v of the elements of `owned` (which must
  // outlive it; runs in increasing order, not overlapping).
  AdamW(const std::vector<model::ParamInfo>& layout, const TrainConfig& tc, std::vector<OwnedRange> owned);
  // A V2/V3 model's tree (for_each_param order).
  AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, std::vector<OwnedRange> owned);
  // The whole buffer.
  AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, model::FlatParams& params,
        model::FlatParams& grads);

  // The owned gradients of every tensor of the tree, frozen ones included
  // (the gradient norm covers them all, as MaxText's does; not the routing
  // bias, which has none).
  std::vector<ops::GradSpan> grad_spans() const;
  // The owned parameters.
  std::vector<ops::GradSpan> param_spans() const;
  // One update at rate lr of every owned trainable element; count() grows by one.
  void update(double lr);
  int64_t count() const { return count_; }
  void set_count(int64_t c) { count_ = c; }
  // f(param, flat_index, n) for each owned piece of the flat range [a, b).
  template <typename F>
  void for_owned(int64_t a, int64_t b, F&& f) const {
    for (const auto& r : owned_) {
      const int64_t x = std::max(a, r.lo), y = std::min(b, r.hi);
      if (x < y) f(r.param + (x - r.lo), x, y - x);
    }
  }

  std::vector<float> m, v;  // the owned elements, in the order of the runs
  const std::vector<TensorSlot>& slots() const { return slots_; }

 private:
  // f(slot, range, first flat index, count, offset of the first in m) for
  // every piece of a tensor inside an owned run.
  template <typename F>
  void for_each_part(F&& f) const;

  ops::AdamWConfig base_;
  std::vector<TensorSlot> slots_;
  std::vector<OwnedRange> owned_;
  std::vector<int64_t> moment_at_;  // per run: its first element's index in m
  int64_t count_ = 0;
};

}  // namespace ds::train
