#include "train/optimizer.h"

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
             model::FlatParams& grads)
    : m(model::FlatParams::zeros(mc, mtp_layers)), v(model::FlatParams::zeros(mc, mtp_layers)) {
  base_.beta1 = static_cast<float>(tc.adam_b1);
  base_.beta2 = static_cast<float>(tc.adam_b2);
  base_.eps = static_cast<float>(tc.adam_eps);
  base_.eps_root = static_cast<float>(tc.adam_eps_root);
  base_.weight_decay = static_cast<float>(tc.adam_weight_decay);
  const auto no_decay = compile(tc.adamw_mask), train_only = compile(tc.trainable_parameters_mask);
  bool any_trainable = false;
  model::for_each_param(
      mc, mtp_layers,
      [&](const model::ParamInfo& i, float* p, float* g, float* mm, float* vv) {
        TensorSlot s{i, p, g, mm, vv, false, false};
        s.trainable = i.trainable() && (train_only.empty() || any_search(train_only, i.name));
        s.decay = i.is_matrix() && !any_search(no_decay, i.name);
        any_trainable |= s.trainable;
        slots_.push_back(std::move(s));
      },
      params.ptr, grads.ptr, m.ptr, v.ptr);
  DS_CHECK(any_trainable, "trainable_parameters_mask matches no parameter: nothing would train");
}

std::vector<ops::GradSpan> AdamW::grad_spans() const {
  std::vector<ops::GradSpan> s;
  for (const auto& t : slots_)
    if (t.info.trainable()) s.push_back({t.grad, t.info.numel()});
  return s;
}

void AdamW::update(double lr) {
  ++count_;
  for (const auto& t : slots_) {
    if (!t.trainable) continue;
    ops::AdamWConfig c = base_;
    c.lr = static_cast<float>(lr);
    if (!t.decay) c.weight_decay = 0.0f;
    ops::adamw_update(t.param, t.m, t.v, t.grad, t.info.numel(), c, count_);
  }
}

}  // namespace ds::train
