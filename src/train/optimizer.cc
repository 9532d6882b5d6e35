#include "train/optimizer.h"

#include <algorithm>
#include <regex>

#include "core/error.h"

namespace ds::train {

namespace {

bool any_search(const std::vector<std::regex>& res, const std::string& name) {
  for (const auto& r : res)
    if (std::regex_search(name, r)) return true;
  return false;
}

std::vector<std::regex> compile(const std::vector<std::string>& v) {
  std::vector<std::regex> out;
  for (const auto& s : v) out.emplace_back(s);
  return out;
}

}  // namespace

AdamW::AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, model::FlatParams& params,
             model::FlatParams& grads, int64_t lo, int64_t hi) {
  const int64_t n = static_cast<int64_t>(params.data.size());
  DS_CHECK(static_cast<int64_t>(grads.data.size()) == n, "internal: AdamW over {} parameters and {} gradients", n,
           grads.data.size());
  lo_ = lo;
  hi_ = hi < 0 ? n : hi;
  DS_CHECK(0 <= lo_ && lo_ <= hi_ && hi_ <= n, "internal: AdamW shard [{}, {}) outside [0, {})", lo_, hi_, n);
  m.assign(static_cast<size_t>(hi_ - lo_), 0.0f);
  v.assign(static_cast<size_t>(hi_ - lo_), 0.0f);
  base_.beta1 = static_cast<float>(tc.adam_b1);
  base_.beta2 = static_cast<float>(tc.adam_b2);
  base_.eps = static_cast<float>(tc.adam_eps);
  base_.eps_root = static_cast<float>(tc.adam_eps_root);
  base_.weight_decay = static_cast<float>(tc.adam_weight_decay);
  const auto no_decay = compile(tc.adamw_mask), train_only = compile(tc.trainable_parameters_mask);
  bool any_trainable = false;
  model::for_each_param(
      mc, mtp_layers,
      [&](const model::ParamInfo& i, float* p, float* g) {
        TensorSlot s{i, p, g, p - params.data.data(), false, false};
        s.trainable = i.trainable() && (train_only.empty() || any_search(train_only, i.name));
        s.decay = i.is_matrix() && !any_search(no_decay, i.name);
        any_trainable |= s.trainable;
        slots_.push_back(std::move(s));
      },
      params.ptr, grads.ptr);
  DS_CHECK(any_trainable, "trainable_parameters_mask matches no parameter: nothing would train");
}

template <typename F>
void AdamW::for_each_part(F&& f) const {
  for (const auto& t : slots_) {
    const int64_t a = std::max(t.offset, lo_), b = std::min(t.offset + t.info.numel(), hi_);
    if (a < b) f(t, a - t.offset, b - a);
  }
}

std::vector<ops::GradSpan> AdamW::grad_spans() const {
  std::vector<ops::GradSpan> s;
  for_each_part([&](const TensorSlot& t, int64_t first, int64_t count) {
    if (t.info.trainable()) s.push_back({t.grad + first, count});
  });
  return s;
}

std::vector<ops::GradSpan> AdamW::param_spans() const {
  std::vector<ops::GradSpan> s;
  for_each_part([&](const TensorSlot& t, int64_t first, int64_t count) { s.push_back({t.param + first, count}); });
  return s;
}

void AdamW::update(double lr) {
  ++count_;
  for_each_part([&](const TensorSlot& t, int64_t first, int64_t count) {
    if (!t.trainable) return;
    ops::AdamWConfig c = base_;
    c.lr = static_cast<float>(lr);
    if (!t.decay) c.weight_decay = 0.0f;
    const int64_t at = t.offset + first - lo_;
    ops::adamw_update(t.param + first, m.data() + at, v.data() + at, t.grad + first, count, c, count_);
  });
}

}  // namespace ds::train
