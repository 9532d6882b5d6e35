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

AdamW::AdamW(const std::vector<model::ParamInfo>& layout, const TrainConfig& tc, std::vector<OwnedRange> owned)
    : owned_(std::move(owned)) {
  int64_t total = 0, prev = 0;
  for (const auto& r : owned_) {
    DS_CHECK(r.lo >= prev && r.hi >= r.lo, "internal: AdamW runs out of order at [{}, {})", r.lo, r.hi);
    prev = r.hi;
    moment_at_.push_back(total);
    total += r.hi - r.lo;
  }
  m.assign(static_cast<size_t>(total), 0.0f);
  v.assign(static_cast<size_t>(total), 0.0f);
  base_.beta1 = static_cast<float>(tc.adam_b1);
  base_.beta2 = static_cast<float>(tc.adam_b2);
  base_.eps = static_cast<float>(tc.adam_eps);
  base_.eps_root = static_cast<float>(tc.adam_eps_root);
  base_.weight_decay = static_cast<float>(tc.adam_weight_decay);
  const auto no_decay = compile(tc.adamw_mask), train_only = compile(tc.trainable_parameters_mask);
  bool any_trainable = false;
  int64_t off = 0;
  for (const model::ParamInfo& i : layout) {
    TensorSlot s{i, off, false, false};
    off += i.numel();
    s.trainable = i.trainable() && (train_only.empty() || any_search(train_only, i.name));
    s.decay = i.is_matrix() && !any_search(no_decay, i.name);
    any_trainable |= s.trainable;
    slots_.push_back(std::move(s));
  }
  DS_CHECK(prev <= off, "internal: AdamW run ends at {} past the {} parameters", prev, off);
  DS_CHECK(any_trainable, "trainable_parameters_mask matches no parameter: nothing would train");
}

AdamW::AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, std::vector<OwnedRange> owned)
    : AdamW(model::param_infos(mc, mtp_layers), tc, std::move(owned)) {}

AdamW::AdamW(const model::ModelConfig& mc, int64_t mtp_layers, const TrainConfig& tc, model::FlatParams& params,
             model::FlatParams& grads)
    : AdamW(mc, mtp_layers, tc,
            {OwnedRange{0, model::FlatParams::numel(mc, mtp_layers), params.data.data(), grads.data.data()}}) {}

template <typename F>
void AdamW::for_each_part(F&& f) const {
  for (size_t k = 0; k < owned_.size(); ++k) {
    const auto& r = owned_[k];
    for (const auto& t : slots_) {
      const int64_t a = std::max(t.offset, r.lo), b = std::min(t.offset + t.info.numel(), r.hi);
      if (a < b) f(t, r, a, b - a, moment_at_[k] + (a - r.lo));
    }
  }
}

std::vector<ops::GradSpan> AdamW::grad_spans() const {
  std::vector<ops::GradSpan> s;
  for_each_part([&](const TensorSlot& t, const OwnedRange& r, int64_t a, int64_t n, int64_t) {
    if (t.info.trainable()) s.push_back({r.grad + (a - r.lo), n});
  });
  return s;
}

std::vector<ops::GradSpan> AdamW::param_spans() const {
  std::vector<ops::GradSpan> s;
  for_each_part(
      [&](const TensorSlot&, const OwnedRange& r, int64_t a, int64_t n, int64_t) { s.push_back({r.param + (a - r.lo), n}); });
  return s;
}

void AdamW::update(double lr) {
  ++count_;
  for_each_part([&](const TensorSlot& t, const OwnedRange& r, int64_t a, int64_t n, int64_t at) {
    if (!t.trainable) return;
    ops::AdamWConfig c = base_;
    c.lr = static_cast<float>(lr);
    if (!t.decay) c.weight_decay = 0.0f;
    ops::adamw_update(r.param + (a - r.lo), m.data() + at, v.data() + at, r.grad + (a - r.lo), n, c, count_);
  });
}

}  // namespace ds::train
