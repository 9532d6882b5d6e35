// DeepSeek-V4 behind the family seam: its loss (model/v4_train.h), its
// parameter tree (model/v4_params.h), Hugging Face import and export
// (model/hf_params.h) and FLOP accounting (model/flops.h).
//
// It binds to whole flat buffers, or (bind_streamed) to trees that FSDP
// fills a layer at a time; expert parallelism computes each routed row on
// its expert's rank through the shared token exchange; remat keeps the
// residuals a policy names (model/v4_model.h's V4Saved) and reruns the
// stages of the rest; the batch split runs each layer over the parts of a
// batch in turn (V4LossOptions::batch_split).
#include "model/family.h"

#include <string>
#include <utility>

#include "core/error.h"
#include "model/flops.h"
#include "model/hf_params.h"
#include "model/v41_init.h"
#include "model/v4_model.h"
#include "model/v4_train.h"

namespace ds::model {

namespace {

class V4Bound final : public BoundModel {
 public:
  V4Bound(const V4Config& cfg, float* params, float* grads) : cfg_(cfg), params_(V4FlatParams::over(cfg, params)) {
    if (grads) grads_ = V4FlatParams::wrap(cfg, grads);
    has_grads_ = grads != nullptr;
  }
  // Over trees that FSDP points, unit by unit (bind_streamed).
  explicit V4Bound(const V4Config& cfg) : cfg_(cfg) {
    params_.ptr = make_v4_params<float*>(cfg);
    params_.view = make_v4_params<ops::WeightView>(cfg);
    params_.tables.resize(static_cast<size_t>(cfg.num_hidden_layers + cfg.num_nextn_predict_layers));
    grads_.ptr = make_v4_params<float*>(cfg);
    has_grads_ = true;
    streamed_ = true;
  }
  // The streamed trees' leaves, and what follows the pointing of a unit:
  // a hash-routed layer's table as int32 ids, a tied head.
  void leaves(TreeLeaves& l) {
    for_each_v4_param(
        cfg_,
        [&](const V4ParamInfo&, ops::WeightView& v, float*& g) {
          l.views.push_back(&v);
          l.grads.push_back(&g);
        },
        params_.view, grads_.ptr);
    l.after_point = [this](int64_t u) {
      if (u == 0 && cfg_.tie_word_embeddings) params_.view.head = params_.view.embed;
      const int64_t l = u - 1;
      if (l < 0 || l >= static_cast<int64_t>(params_.tables.size()) || !cfg_.hash_routed(l)) return;
      ops::WeightView& v = params_.view.layers[static_cast<size_t>(l)].tid2eid;
      if (!v.data) return;
      auto& t = params_.tables[static_cast<size_t>(l)];
      t.resize(static_cast<size_t>(v.rows * v.cols));
      v4_hash_table(cfg_, "layers." + std::to_string(l) + ".ffn.gate.tid2eid", static_cast<const float*>(v.data),
                    v.cols, t);
      v = {t.data(), DType::I32, v.rows, v.cols, nullptr, 128, 128};
    };
  }

  LossTerms loss_and_grad(const TrainBatch& batch, const LossOptions& opt, const RematPolicy& remat,
                          bool grads) override {
    DS_CHECK(!grads || has_grads_, "internal: a gradient asked of a model bound without a gradient buffer");
    V4LossOptions o;
    o.remat = remat;
    o.exchange = opt.exchange;
    o.stream = opt.stream;
    o.load_balance_loss_weight = opt.load_balance_loss_weight;
    o.z_loss_multiplier = opt.z_loss_multiplier;
    o.grad_scale = opt.grad_scale;
    o.expert_load = grads;
    o.mtp = opt.mtp_num_layers > 0;
    o.mtp_loss_scaling_factor = opt.mtp_loss_scaling_factor;
    o.batch_split = opt.batch_split_factor;
    if (opt.whole.rows > 0) {
      o.whole_targets = opt.whole.targets;
      o.whole_mtp_targets = opt.whole.mtp_targets;
      o.whole_rows = opt.whole.rows;
    }
    auto t4 = v4_loss_and_grad(cfg_, params_.view, grads ? &grads_.ptr : nullptr, V4TrainBatch::from_packed(batch), o);
    LossTerms t;
    t.loss = t4.loss;
    t.lm_loss = t4.lm_loss;
    t.z_loss = t4.z_loss;
    t.mtp_loss = t4.mtp_loss;
    t.moe_lb_loss = t4.moe_lb_loss;
    t.tokens = static_cast<double>(t4.tokens);
    t.expert_load = std::move(t4.expert_load);
    t.saved_bytes = t4.saved_bytes;
    return t;
  }

  // Streamed trees derive their tables as each unit is pointed.
  void params_changed() override {
    if (!streamed_) params_.sync_tables(cfg_);
  }

 private:
  const V4Config& cfg_;
  V4FlatParams params_, grads_;
  bool has_grads_ = false, streamed_ = false;
};

class V4Family final : public Family {
 public:
  V4Family(const V4Config& cfg, double rate) : cfg_(cfg), rate_(rate) {}

  std::string name() const override { return cfg_.v41() ? "DeepSeek-V4.1" : "DeepSeek-V4"; }
  nlohmann::json hf_config() const override { return cfg_.to_hf_json(); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_positions() const override { return cfg_.max_position_embeddings; }
  int64_t mtp_layers() const override { return cfg_.num_nextn_predict_layers; }

  std::vector<ParamInfo> layout() const override { return v4_param_infos(cfg_); }
  int64_t numel() const override { return V4FlatParams::numel(cfg_); }
  int64_t routed_experts() const override { return cfg_.n_routed_experts; }
  std::vector<int64_t> moe_layers() const override {
    std::vector<int64_t> v;  // every layer, the MTP blocks last
    for (int64_t l = 0; l < cfg_.num_hidden_layers + cfg_.num_nextn_predict_layers; ++l) v.push_back(l);
    return v;
  }
  double routed_bias_update_rate() const override { return rate_; }
  double saved_bytes_per_token(const RematPolicy& keep, bool bf16, int64_t seq) const override {
    return v4_saved_bytes_per_token(cfg_, keep, bf16, seq);
  }

  void init(float* params, uint64_t seed, float std) const override {
    auto p = V4FlatParams::over(cfg_, params);
    init_v4_params(cfg_, p, seed, std);
  }
  void load_hf(const std::string& dir, float* params) const override {
    auto p = V4FlatParams::over(cfg_, params);
    load_v4_hf_params(dir, cfg_, p);
  }
  void export_hf(const std::string& out_dir, const float* params, DType dtype, const char* who) const override {
    export_v4_hf(out_dir, cfg_, params, dtype, who);
  }
  // DeepSeek-V4.1 in its release's formats (fp8 32 x 32 blocks with e8m0
  // scales, packed fp4 experts, fp8 Engram tables): model/v41_init.h.
  std::vector<DType> init_dtypes() const override {
    if (cfg_.v41()) return {DType::F8E4M3};
    return Family::init_dtypes();
  }
  void write_random(const std::string& out_dir, uint64_t seed, float std, DType dtype,
                    const std::string& tokenizer) const override {
    if (!cfg_.v41()) return Family::write_random(out_dir, seed, std, dtype, tokenizer);
    DS_CHECK(dtype == DType::F8E4M3,
             "init: a DeepSeek-V4.1 model is written in its checkpoint's formats (--dtype fp8)");
    write_random_v41(cfg_, out_dir, seed, tokenizer);
  }

  double step_flops(int64_t batch, int64_t seq, int64_t grad_accum) const override {
    return v4_step_flops(cfg_, batch, seq, grad_accum);
  }

  LossOptions::Whole loss_weights(const TrainBatch& whole, bool mtp) const override {
    const auto w = v4_loss_weights(V4TrainBatch::from_packed(whole));
    return {w.targets, mtp ? w.mtp_targets : 0.0, whole.batch};
  }
  void check_loss_options(const LossOptions& o) const override {
    DS_CHECK(o.indexer_loss_scaling_factor == 0 && !o.indexer_sparse_training,
             "indexer_sparse_training / indexer_loss_scaling_factor: DeepSeek-V4's lightning indexer is not trained "
             "(its CSA layers always attend through it)");
  }
  std::string training_note(const LossOptions&) const override {
    if (cfg_.v41())
      return "each document piece its own sequence; the lightning indexer stays as it is (its choices are the "
             "step's constants); Engram's tables get gradients at the rows looked up; the attention keeps its "
             "residuals under every remat_policy (its readers take their entries and choices from other layers), "
             "the MoE's are recomputed when the policy drops them";
    return "each document piece its own sequence; the lightning indexer and the hash table stay as they are; the "
           "backward recomputes the residuals remat_policy drops (the attention's stages skip the kept ones, the "
           "MoE's expert products are recomputed together)";
  }

  std::unique_ptr<BoundModel> bind(float* params, float* grads) const override {
    return std::make_unique<V4Bound>(cfg_, params, grads);
  }
  std::unique_ptr<StreamedModel> bind_streamed() const override {
    auto bound = std::make_unique<V4Bound>(cfg_);
    auto sm = std::make_unique<StreamedModel>();
    bound->leaves(sm->leaves);
    sm->bound = std::move(bound);
    return sm;
  }

 private:
  const V4Config cfg_;
  const double rate_;
};

}  // namespace

std::unique_ptr<Family> v4_family(const V4Config& cfg, double routed_bias_update_rate) {
  return std::make_unique<V4Family>(cfg, routed_bias_update_rate);
}

}  // namespace ds::model
