// One training step (forward + backward of model::loss_and_grad) of the
// `tiny` and `small` presets per remat policy: tokens/s, the residual bytes
// the forward keeps (counter saved_MiB), and model TFLOP/s by MaxText's
// accounting (6 x parameters touched per token, plus causal attention).
// TrainStepV4: the same for `v4-tiny` (model::v4_loss_and_grad), whose
// layers keep or recompute whole sub-layers: everything, the attention's
// residuals alone, the MoE's alone, or only each layer's input (full).
// TrainStepBf16 and TrainStepV4Bf16: the same steps with dtype=bfloat16
// (ops/matmul.h: bf16 operands, float32 sums).
//
//   ./build/bench/train_step_bench --benchmark_min_time=2
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/model.h"
#include "model/v4_train.h"
#include "ops/matmul.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/flops.h"

namespace {

using namespace ds;

std::string preset(const char* name) { return std::string(DEEPSEEK_SOURCE_DIR) + "/configs/" + name + ".yml"; }

void TrainStep(benchmark::State& state, const char* name, const char* policy, ops::GemmDtype dtype) {
  const ops::ScopedGemmDtype arithmetic(dtype);
  const auto cfg = model::ModelConfig::from_yaml_file(preset(name));
  const int64_t B = state.range(0), T = state.range(1);
  model::FlatParams p = model::FlatParams::zeros(cfg, 0);
  fill_normal(p.data.data(), static_cast<int64_t>(p.data.size()), 0.02f, 1);
  model::for_each_param(
      cfg, 0,
      [&](const model::ParamInfo& i, float* w) {
        if (i.role == model::ParamRole::Norm) std::fill(w, w + i.numel(), 1.0f);
        if (i.role == model::ParamRole::RoutingBias) std::fill(w, w + i.numel(), 0.0f);
      },
      p.ptr);
  model::FlatParams g = model::FlatParams::zeros(cfg, 0);
  model::TrainBatch b;
  b.batch = B;
  b.seq = T;
  const Philox rng(7);
  for (int64_t i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.u32(2 * i) % cfg.vocab_size));
    b.targets.push_back(static_cast<int32_t>(rng.u32(2 * i + 1) % cfg.vocab_size));
    b.positions.push_back(static_cast<int32_t>(i % T));
    b.segment_ids.push_back(1);
    b.target_segment_ids.push_back(1);
  }
  const auto rp = model::RematPolicy::from_name(policy);
  const ops::ScopedBf16Weights bf16_weights(p.data.data(), static_cast<int64_t>(p.data.size()));
  model::LossTerms t;
  for (auto _ : state) {
    t = model::loss_and_grad(cfg, p.view, &g.ptr, b, {}, rp);
    benchmark::DoNotOptimize(g.data.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(B * T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["TFLOP_per_s"] =
      benchmark::Counter(train::step_flops(cfg, B, T) / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["saved_MiB"] = double(t.saved_bytes) / (1 << 20);
}

model::RematPolicy v4_policy(const std::string& name) {
  std::vector<std::pair<std::string, std::string>> kv;
  const std::vector<const char*> attention = {"query_wa_proj", "mla_q",         "kv_wa_proj", "kv_proj",
                                              "query_proj",    "attention_out", "context",    "out_proj"};
  const std::vector<const char*> moe = {"mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"};
  if (name == "keep_all") return model::RematPolicy::keep_all();
  if (name != "attention" && name != "moe") return model::RematPolicy::from_name(name);
  for (const char* n : name == "attention" ? attention : moe) kv.emplace_back(n, "device");
  return model::RematPolicy::from_name("custom", kv);
}

void TrainStepV4(benchmark::State& state, const std::string& policy, ops::GemmDtype dtype) {
  const ops::ScopedGemmDtype arithmetic(dtype);
  const auto rc = train::parse_run_config("", {"model_name=" + preset("v4-tiny")}, "bench");
  const auto& c = *rc.v4;
  const int64_t B = state.range(0), T = state.range(1);
  auto p = model::V4FlatParams::zeros(c);
  model::init_v4_params(c, p, 1, 0.02f);
  auto g = model::V4FlatParams::zeros(c);
  const Philox rng(7);
  std::vector<int32_t> in, tg;
  for (int64_t i = 0; i < B * T; ++i) {
    in.push_back(static_cast<int32_t>(rng.u32(2 * i) % c.vocab_size));
    tg.push_back(static_cast<int32_t>(rng.u32(2 * i + 1) % c.vocab_size));
  }
  const auto b = model::V4TrainBatch::rows(B, T, in, tg);
  model::V4LossOptions o;
  o.remat = v4_policy(policy);
  const ops::ScopedBf16Weights bf16_weights(p.data.data(), static_cast<int64_t>(p.data.size()));
  model::V4LossTerms t;
  for (auto _ : state) {
    t = model::v4_loss_and_grad(c, p.view, &g.ptr, b, o);
    benchmark::DoNotOptimize(g.data.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(B * T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["saved_MiB"] = double(t.saved_bytes) / (1 << 20);
}

void register_all() {
  for (const auto dtype : {ops::GemmDtype::kF32, ops::GemmDtype::kBf16}) {
    const std::string suffix = dtype == ops::GemmDtype::kBf16 ? "Bf16" : "";
    for (const char* policy :
         {"keep_all", "attention", "moe", "minimal_with_context", "minimal", "save_qkv_proj", "full"})
      benchmark::RegisterBenchmark(("TrainStepV4" + suffix + "/v4-tiny/" + policy).c_str(), TrainStepV4,
                                   std::string(policy), dtype)
          ->Args({8, 128})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    for (const char* name : {"tiny", "small"})
      for (const char* policy : {"full", "minimal", "save_dot_except_mlp", "save_qkv_proj"}) {
        auto* b = benchmark::RegisterBenchmark(("TrainStep" + suffix + "/" + name + "/" + policy).c_str(), TrainStep,
                                               name, policy, dtype);
        b->Args({8, 128})->Unit(benchmark::kMillisecond)->UseRealTime();
      }
  }
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
