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
#include "ops/linear.h"

namespace ds::model {

V4ExpertRows::V4ExpertRows(const int32_t* experts, int64_t n, int64_t K, int64_t E, bool shared)
    : first(static_cast<size_t>(E + 1), 0), row(static_cast<size_t>(n * K)), assignment(row.size()) {
  for (int64_t a = 0; a < n * K; ++a) ++first[static_cast<size_t>(experts[a] + 1)];
  for (int64_t e = 0; e < E; ++e) first[static_cast<size_t>(e + 1)] += first[static_cast<size_t>(e)];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t a = 0; a < n * K; ++a) {
    const int64_t r = next[static_cast<size_t>(experts[a])]++;
    row[static_cast<size_t>(a)] = r;
    assignment[static_cast<size_t>(r)] = a;
  }
  if (shared) tasks.push_back(-1);
  for (int64_t e = 0; e < E; ++e)
    if (rows(e) > 0) tasks.push_back(e);
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t x, int64_t y) {
    auto size = [&](int64_t e) { return e < 0 ? n : rows(e); };
    return size(x) > size(y);
  });
}

bool V4ExpertRows::as_tasks(int64_t hidden, int64_t intermediate) const {
  const int64_t T = static_cast<int64_t>(tasks.size());
  // Multiply-adds of one product of an average task.
  const double macs = static_cast<double>(row.size()) / static_cast<double>(std::max<int64_t>(T, 1)) *
                      static_cast<double>(hidden) * static_cast<double>(intermediate);
  return T >= 2 * num_threads() && macs < static_cast<double>(int64_t{1} << 24);
}

void v4_add_by_expert(float* out, const float* rows, const float* w, const V4ExpertRows& er, int64_t n, int64_t K,
                      int64_t d) {
  parallel_ranges(n, n * K * d >= (int64_t{1} << 16), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> order(static_cast<size_t>(K));
    for (int64_t t = t0; t < t1; ++t) {
      // Rows are expert-major, so ascending rows are the experts' order.
      for (int64_t j = 0; j < K; ++j) order[static_cast<size_t>(j)] = er.row[static_cast<size_t>(t * K + j)];
      std::sort(order.begin(), order.end());
      float* dst = out + t * d;
      for (const int64_t r : order) {
        const float* src = rows + r * d;
        if (w) {
          const float wgt = w[er.assignment[static_cast<size_t>(r)]];
          for (int64_t c = 0; c < d; ++c) dst[c] += wgt * src[c];
        } else {
          for (int64_t c = 0; c < d; ++c) dst[c] += src[c];
        }
      }
    }
  });
}

V4ExpertRows V4ExpertRows::grouped(const std::vector<int32_t>& sizes, bool shared, int64_t n) {
  V4ExpertRows er;
  const int64_t E = static_cast<int64_t>(sizes.size());
  er.first.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) er.first[static_cast<size_t>(e + 1)] = er.first[static_cast<size_t>(e)] + sizes[e];
  er.row.resize(static_cast<size_t>(er.total()));  // as_tasks counts them
  if (shared) er.tasks.push_back(-1);
  for (int64_t e = 0; e < E; ++e)
    if (sizes[static_cast<size_t>(e)] > 0) er.tasks.push_back(e);
  std::stable_sort(er.tasks.begin(), er.tasks.end(), [&](int64_t x, int64_t y) {
    auto size = [&](int64_t e) { return e < 0 ? n : er.rows(e); };
    return size(x) > size(y);
  });
  return er;
}

Staged V4Model::moe(float* out, const float* x, const int32_t* ids, int64_t layer, int64_t n, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t d = cfg_.hidden_size, E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  Buffer<float> logits(static_cast<size_t>(n * E)), scores(static_cast<size_t>(n * E));
  ops::linear_forward(logits.data(), x, L.gate, n);
  const ops::ExpertSelectionConfig sc = v4_selection_config(cfg_);
  std::vector<int32_t> experts(static_cast<size_t>(n * K)), fixed;
  std::vector<float> weights(static_cast<size_t>(n * K));
  const bool hashed = cfg_.hash_routed(layer);
  if (hashed) {
    const auto* table = static_cast<const int32_t*>(L.tid2eid.data);
    fixed.resize(static_cast<size_t>(n * K));
    for (int64_t i = 0; i < n; ++i) std::copy(table + ids[i] * K, table + (ids[i] + 1) * K, fixed.begin() + i * K);
  }
  ops::expert_selection_forward(experts.data(), weights.data(), scores.data(), logits.data(),
                                hashed ? nullptr : vector_data(L.gate_bias), n, sc, hashed ? fixed.data() : nullptr);

  // Every routed expert's rows in expert-major buffers: its outputs ys and
  // g = w1 x, u = w3 x, h = silu(g) * u (training keeps them all).
  V4ExpertRows er(experts.data(), n, K, E, cfg_.n_shared_experts > 0);
  Buffer<float> own[7];
  Buffer<float>& ys = sv ? sv->y : own[0];
  Buffer<float>* inner = sv ? nullptr : own + 1;  // g, u, h, sg, su, sh when not kept
  if (opt_.exchange)
    co_await experts_exchanged(out, ys, x, layer, n, er, inner, sv);
  else
    experts_local(out, ys, x, layer, n, er, inner, sv);
  if (cfg_.n_shared_experts == 0) std::fill(out, out + n * d, 0.0f);
  v4_add_by_expert(out, ys.data(), weights.data(), er, n, K, d);
  if (sv) {
    sv->experts = std::move(experts);
    sv->weights = std::move(weights);
    sv->scores.assign(scores.begin(), scores.end());
    if (!hashed && L.gate_bias.data) sv->bias.assign(vector_data(L.gate_bias), vector_data(L.gate_bias) + E);
    sv->rows = std::move(er);
  }
}

namespace {

// The routed experts' g, u, h ([rows, I]) and the shared expert's ([n, I]),
// kept in sv or in the caller's six scratch buffers.
struct ExpertBuffers {
  Buffer<float>&g, &u, &h, &sg, &su, &sh;
};
ExpertBuffers expert_buffers(V4MoeSaved* sv, Buffer<float>* inner, int64_t rows, int64_t n, int64_t I, bool shared) {
  ExpertBuffers b = sv ? ExpertBuffers{sv->g, sv->u, sv->h, sv->sg, sv->su, sv->sh}
                       : ExpertBuffers{inner[0], inner[1], inner[2], inner[3], inner[4], inner[5]};
  for (Buffer<float>* x : {&b.g, &b.u, &b.h}) x->resize(static_cast<size_t>(rows * I));
  if (shared)
    for (Buffer<float>* x : {&b.sg, &b.su, &b.sh}) x->resize(static_cast<size_t>(n * I));
  return b;
}

// w2(silu(w1 x) * w3 x) with the clamp, for `rows` rows.
void swiglu_rows(float* y, const float* xs, int64_t rows, const V4MlpParams<ops::WeightView>& mp, float* gr, float* ur,
                 float* hr, int64_t I, float limit) {
  ops::linear_forward(gr, xs, mp.w1, rows);
  ops::linear_forward(ur, xs, mp.w3, rows);
  ops::silu_mul_forward(hr, gr, ur, rows * I, limit);
  ops::linear_forward(y, hr, mp.w2, rows);
}

}  // namespace

void V4Model::experts_local(float* out, Buffer<float>& ys, const float* x, int64_t layer, int64_t n,
                            const V4ExpertRows& er, Buffer<float>* inner, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t d = cfg_.hidden_size, K = cfg_.num_experts_per_tok, I = cfg_.moe_intermediate_size;
  const float limit = static_cast<float>(cfg_.swiglu_limit);
  const size_t A = static_cast<size_t>(n * K);
  auto [g, u, h, sg, su, sh] = expert_buffers(sv, inner, static_cast<int64_t>(A), n, I, cfg_.n_shared_experts > 0);
  ys.resize(A * static_cast<size_t>(d));
  // One task per expert; the shared expert's writes out. Many small experts
  // run on a thread each (a threaded product that small costs more in
  // overhead than in arithmetic); a few experts (decode), or large ones, run
  // one after another with every thread inside each product, which leaves no
  // thread idle at the end. A product's result does not depend on the thread
  // count, so neither does out.
  parallel_tasks(static_cast<int64_t>(er.tasks.size()), er.as_tasks(d, I), [&](int64_t t) {
    const int64_t e = er.tasks[static_cast<size_t>(t)];
    if (e < 0) {
      swiglu_rows(out, x, n, L.shared, sg.data(), su.data(), sh.data(), I, limit);
      return;
    }
    const int64_t r0 = er.first[static_cast<size_t>(e)], cnt = er.rows(e);
    Buffer<float> xs(static_cast<size_t>(cnt * d));
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t tok = er.assignment[static_cast<size_t>(r0 + j)] / K;
      std::copy(x + tok * d, x + (tok + 1) * d, xs.begin() + j * d);
    }
    swiglu_rows(ys.data() + r0 * d, xs.data(), cnt, L.experts[static_cast<size_t>(e)], g.data() + r0 * I,
                u.data() + r0 * I, h.data() + r0 * I, I, limit);
  });
}

Staged V4Model::experts_exchanged(float* out, Buffer<float>& ys, const float* x, int64_t layer, int64_t n,
                                  const V4ExpertRows& er, Buffer<float>* inner, V4MoeSaved* sv) {
  const auto& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t d = cfg_.hidden_size, K = cfg_.num_experts_per_tok, I = cfg_.moe_intermediate_size;
  const int64_t E = cfg_.n_routed_experts;
  const float limit = static_cast<float>(cfg_.swiglu_limit);
  const size_t A = static_cast<size_t>(n * K);
  // This rank's rows in expert order, planned and sent to their experts' ranks.
  Buffer<float> xs(A * static_cast<size_t>(d));
  parallel_ranges(static_cast<int64_t>(A), true, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t tok = er.assignment[static_cast<size_t>(r)] / K;
      std::copy(x + tok * d, x + (tok + 1) * d, xs.begin() + r * d);
    }
  });
  std::vector<int32_t> sizes(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) sizes[static_cast<size_t>(e)] = static_cast<int32_t>(er.rows(e));
  ExchangePlan own_plan;
  ExchangePlan& plan = sv ? sv->plan : own_plan;
  opt_.exchange->plan(plan, sizes);
  Buffer<float> own_xl;
  Buffer<float>& xl = sv ? sv->xl : own_xl;
  xl.resize(static_cast<size_t>(plan.local_rows * d));
  {
    auto moved = opt_.exchange->start_dispatch(xl.data(), xs.data(), plan, d, false);
    co_await Pending{&moved};
  }
  // The local rows, grouped by expert, and the shared expert on this rank's tokens.
  V4ExpertRows own_local = V4ExpertRows::grouped(plan.local_sizes, cfg_.n_shared_experts > 0, n);
  V4ExpertRows& local = sv ? sv->local : own_local;
  if (sv) local = std::move(own_local);
  const size_t R = static_cast<size_t>(plan.local_rows);
  auto [g, u, h, sg, su, sh] = expert_buffers(sv, inner, static_cast<int64_t>(R), n, I, cfg_.n_shared_experts > 0);
  Buffer<float> yl(R * static_cast<size_t>(d));
  parallel_tasks(static_cast<int64_t>(local.tasks.size()), local.as_tasks(d, I), [&](int64_t t) {
    const int64_t e = local.tasks[static_cast<size_t>(t)];
    if (e < 0) {
      swiglu_rows(out, x, n, L.shared, sg.data(), su.data(), sh.data(), I, limit);
      return;
    }
    const int64_t r0 = local.first[static_cast<size_t>(e)];
    swiglu_rows(yl.data() + r0 * d, xl.data() + r0 * d, local.rows(e), L.experts[static_cast<size_t>(e)],
                g.data() + r0 * I, u.data() + r0 * I, h.data() + r0 * I, I, limit);
  });
  // The results back to the ranks of their tokens, in this rank's order.
  ys.resize(A * static_cast<size_t>(d));
  auto back = opt_.exchange->start_undispatch(ys.data(), yl.data(), plan, d);
  co_await Pending{&back};
}

}  // namespace ds::model
