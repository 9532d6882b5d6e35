// DeepSeek-V4's MoE (model/v4_model.h): hash or sqrt-softplus routing, the
// routed experts (on this rank, or through the token exchange on their
// experts' ranks) and the shared expert, and the combine.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/v4_model.h"
#include "model/weights.h"
#include "ops/activations.h"
#include "ops/expert_selection.h"
#include "ops/fp8_quant.h"
#include "ops/linear.h"
#include "ops/routing.h"

namespace ds::model {

V4ExpertTasks::V4ExpertTasks(const std::vector<int32_t>& sizes, bool shared, int64_t n) {
  const int64_t E = static_cast<int64_t>(sizes.size());
  first.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) first[static_cast<size_t>(e + 1)] = first[static_cast<size_t>(e)] + sizes[e];
  if (shared) tasks.push_back(-1);
  for (int64_t e = 0; e < E; ++e)
    if (sizes[static_cast<size_t>(e)] > 0) tasks.push_back(e);
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t x, int64_t y) {
    auto size = [&](int64_t e) { return e < 0 ? n : rows(e); };
    return size(x) > size(y);
  });
}

bool V4ExpertTasks::as_tasks(int64_t hidden, int64_t intermediate) const {
  const int64_t T = static_cast<int64_t>(tasks.size());
  // Multiply-adds of one product of an average task.
  const double macs = static_cast<double>(total()) / static_cast<double>(std::max<int64_t>(T, 1)) *
                      static_cast<double>(hidden) * static_cast<double>(intermediate);
  return T >= 2 * num_threads() && macs < static_cast<double>(int64_t{1} << 24);
}

Staged V4Model::moe(float* out, const float* x, const int32_t* ids, int64_t layer, int64_t n, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t d = cfg_.hidden_size, E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  // Selection (hash-routed layers take their experts from tid2eid and only
  // weigh them; the others score by sqrt(softplus) plus the bias) and route.
  Routing own_r;
  Routing& r = sv ? sv->r : own_r;
  r.tokens = n;
  r.k = K;
  Buffer<float> logits(static_cast<size_t>(n * E));
  r.scores.resize(n * E);
  r.experts.resize(n * K);
  r.weights.resize(n * K);
  {
    const ops::ScopedFloat32Products f32;  // the router stays float32 (stages.cc)
    ops::linear_forward(logits.data(), x, L.gate, n);
  }
  std::vector<int32_t> fixed;
  const bool hashed = cfg_.hash_routed(layer);
  if (hashed) {
    const auto* table = static_cast<const int32_t*>(L.tid2eid.data);
    fixed.resize(static_cast<size_t>(n * K));
    for (int64_t i = 0; i < n; ++i) std::copy(table + ids[i] * K, table + (ids[i] + 1) * K, fixed.begin() + i * K);
  }
  ops::expert_selection_forward(r.experts.data(), r.weights.data(), r.scores.data(), logits.data(),
                                hashed ? nullptr : vector_data(L.gate_bias), n, v4_selection_config(cfg_),
                                hashed ? fixed.data() : nullptr);
  route(r, E);

  // Every routed expert's rows in expert-major buffers: its outputs ys and
  // g = w1 x, u = w3 x (training keeps them; the backward recomputes the
  // activation from them); then the combine.
  Buffer<float> own[5];
  Buffer<float>& ys = sv ? sv->y : own[0];
  Buffer<float>* inner = sv ? nullptr : own + 1;  // g, u, sg, su when not kept
  if (opt_.exchange) {
    co_await experts_exchanged(out, ys, x, layer, r, inner, sv);
  } else {
    V4ExpertTasks own_tasks(r.sizes, cfg_.n_shared_experts > 0, n);
    V4ExpertTasks& et = sv ? sv->tasks : own_tasks;
    if (sv) et = std::move(own_tasks);
    experts_local(out, ys, x, layer, r, et, inner, sv);
  }
  if (cfg_.n_shared_experts == 0) std::fill(out, out + n * d, 0.0f);
  combine_forward(out, ys.data(), r, d, CombineOrder::Experts);
  if (sv && !hashed && L.gate_bias.data) sv->bias.assign(vector_data(L.gate_bias), vector_data(L.gate_bias) + E);
}

namespace {

// The routed experts' g, u ([rows, I]) and the shared expert's ([n, I]),
// kept in sv or in the caller's scratch buffers.
struct ExpertBuffers {
  Buffer<float>&g, &u, &sg, &su;
};
ExpertBuffers expert_buffers(V4MoeSaved* sv, Buffer<float>* inner, int64_t rows, int64_t n, int64_t I, bool shared) {
  ExpertBuffers b =
      sv ? ExpertBuffers{sv->g, sv->u, sv->sg, sv->su} : ExpertBuffers{inner[0], inner[1], inner[2], inner[3]};
  for (Buffer<float>* x : {&b.g, &b.u}) x->resize(static_cast<size_t>(rows * I));
  if (shared)
    for (Buffer<float>* x : {&b.sg, &b.su}) x->resize(static_cast<size_t>(n * I));
  return b;
}

}  // namespace

void V4Model::experts_local(float* out, Buffer<float>& ys, const float* x, int64_t layer, const Routing& r,
                            const V4ExpertTasks& et, Buffer<float>* inner, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t n = r.tokens, d = cfg_.hidden_size, K = r.k, I = cfg_.moe_intermediate_size;
  const float limit = static_cast<float>(cfg_.swiglu_limit);
  const size_t A = static_cast<size_t>(n * K);
  auto [g, u, sg, su] = expert_buffers(sv, inner, static_cast<int64_t>(A), n, I, cfg_.n_shared_experts > 0);
  ys.resize(A * static_cast<size_t>(d));
  // One task per expert; the shared expert's writes out. Many small experts
  // run on a thread each (a threaded product that small costs more in
  // overhead than in arithmetic); a few experts (decode), or large ones, run
  // one after another with every thread inside each product, which leaves no
  // thread idle at the end. A product's result does not depend on the thread
  // count, so neither does out.
  parallel_tasks(static_cast<int64_t>(et.tasks.size()), et.as_tasks(d, I), [&](int64_t t) {
    const int64_t e = et.tasks[static_cast<size_t>(t)];
    if (e < 0) {
      mlp_forward(out, sg.data(), su.data(), x, as_mlp(L.shared), n, limit);
      return;
    }
    const int64_t r0 = et.first[static_cast<size_t>(e)], cnt = et.rows(e);
    Buffer<float> xs(static_cast<size_t>(cnt * d));
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t tok = r.order[r0 + j] / K;
      std::copy(x + tok * d, x + (tok + 1) * d, xs.begin() + j * d);
    }
    mlp_forward(ys.data() + r0 * d, g.data() + r0 * I, u.data() + r0 * I, xs.data(),
                as_mlp(L.experts[static_cast<size_t>(e)]), cnt, limit);
  });
}

Staged V4Model::experts_exchanged(float* out, Buffer<float>& ys, const float* x, int64_t layer, const Routing& r,
                                  Buffer<float>* inner, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t n = r.tokens, d = cfg_.hidden_size, K = r.k, I = cfg_.moe_intermediate_size;
  const float limit = static_cast<float>(cfg_.swiglu_limit);
  const size_t A = static_cast<size_t>(n * K);
  // This rank's rows in expert order, planned and sent to their experts' ranks.
  Buffer<float> xs(A * static_cast<size_t>(d));
  ops::route_forward(xs.data(), x, r.order.data(), n, K, d);
  ExchangePlan own_plan;
  ExchangePlan& plan = sv ? sv->plan : own_plan;
  opt_.exchange->plan(plan, r.sizes);
  Buffer<float> own_xl;
  Buffer<float>& xl = sv ? sv->xl : own_xl;
  xl.resize(static_cast<size_t>(plan.local_rows * d));
  {
    auto moved = opt_.exchange->start_dispatch(xl.data(), xs.data(), plan, d, false);
    co_await Pending{&moved};
  }
  // The local rows, grouped by expert, and the shared expert on this rank's tokens.
  V4ExpertTasks own_local(plan.local_sizes, cfg_.n_shared_experts > 0, n);
  V4ExpertTasks& local = sv ? sv->local : own_local;
  if (sv) local = std::move(own_local);
  const size_t R = static_cast<size_t>(plan.local_rows);
  auto [g, u, sg, su] = expert_buffers(sv, inner, static_cast<int64_t>(R), n, I, cfg_.n_shared_experts > 0);
  Buffer<float> yl(R * static_cast<size_t>(d));
  parallel_tasks(static_cast<int64_t>(local.tasks.size()), local.as_tasks(d, I), [&](int64_t t) {
    const int64_t e = local.tasks[static_cast<size_t>(t)];
    if (e < 0) {
      mlp_forward(out, sg.data(), su.data(), x, as_mlp(L.shared), n, limit);
      return;
    }
    const int64_t r0 = local.first[static_cast<size_t>(e)];
    mlp_forward(yl.data() + r0 * d, g.data() + r0 * I, u.data() + r0 * I, xl.data() + r0 * d,
                as_mlp(L.experts[static_cast<size_t>(e)]), local.rows(e), limit);
  });
  // The results back to the ranks of their tokens, in this rank's order.
  ys.resize(A * static_cast<size_t>(d));
  auto back = opt_.exchange->start_undispatch(ys.data(), yl.data(), plan, d);
  co_await Pending{&back};
}

}  // namespace ds::model
