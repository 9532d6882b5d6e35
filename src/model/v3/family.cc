// DeepSeek-V2/V3/V3.2 behind the family seam: the stage functions' loss
// (model/model.h), its parameter tree (model/params.h), Hugging Face import
// and export (model/hf_params.h) and FLOP accounting (model/flops.h).
#include "model/family.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <utility>

#include "core/error.h"
#include "model/flops.h"
#include "model/hf_params.h"
#include "model/init.h"
#include "model/layer.h"

namespace ds::model {

namespace {

class V3Bound final : public BoundModel {
 public:
  V3Bound(const ModelConfig& cfg, int64_t mtp, float* params, float* grads)
      : cfg_(cfg), params_(FlatParams::wrap(cfg, mtp, params)) {
    if (grads) grads_ = FlatParams::wrap(cfg, mtp, grads);
    view_ = &params_.view;
    tree_ = grads ? &grads_.ptr : nullptr;
  }
  V3Bound(const ModelConfig& cfg, const ParamsView& view, ModelParams<float*>* grads)
      : cfg_(cfg), view_(&view), tree_(grads) {}

  LossTerms loss_and_grad(const TrainBatch& batch, const LossOptions& opt, const RematPolicy& remat,
                          bool grads) override {
    DS_CHECK(!grads || tree_, "internal: a gradient asked of a model bound without a gradient buffer");
    return model::loss_and_grad(cfg_, *view_, grads ? tree_ : nullptr, batch, opt, remat);
  }

 private:
  const ModelConfig& cfg_;
  FlatParams params_, grads_;
  const ParamsView* view_ = nullptr;
  ModelParams<float*>* tree_ = nullptr;
};

class V3Family final : public Family {
 public:
  V3Family(const ModelConfig& cfg, int64_t mtp) : cfg_(cfg), mtp_(mtp) {}

  std::string name() const override { return "DeepSeek-V3"; }
  nlohmann::json hf_config() const override { return to_hf_json(cfg_, mtp_); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_positions() const override { return cfg_.max_position_embeddings; }
  int64_t mtp_layers() const override { return mtp_; }

  std::vector<ParamInfo> layout() const override { return param_infos(cfg_, mtp_); }
  int64_t numel() const override { return FlatParams::numel(cfg_, mtp_); }
  int64_t routed_experts() const override { return cfg_.n_routed_experts; }
  std::vector<int64_t> moe_layers() const override {
    std::vector<int64_t> v;
    for (int64_t l = 0; l < cfg_.num_hidden_layers + mtp_; ++l)
      if (cfg_.is_moe_layer(l)) v.push_back(l);
    return v;
  }
  double routed_bias_update_rate() const override { return cfg_.routed_bias_update_rate; }

  void init(float* params, uint64_t seed, float std) const override {
    auto p = FlatParams::wrap(cfg_, mtp_, params);
    init_params(cfg_, mtp_, p, seed, std);
  }
  void load_hf(const std::string& dir, float* params) const override {
    auto p = FlatParams::wrap(cfg_, mtp_, params);
    load_hf_params(dir, cfg_, mtp_, p);
  }
  void export_hf(const std::string& out_dir, const float* params, DType dtype, const char*) const override {
    const auto p = FlatParams::wrap(cfg_, mtp_, const_cast<float*>(params));
    model::export_hf(out_dir, cfg_, mtp_, p, dtype);
  }
  // Also fp8, as DeepSeek-V3 ships: e4m3 projections with 128 x 128 block scales.
  std::vector<DType> init_dtypes() const override { return {DType::BF16, DType::F16, DType::F32, DType::F8E4M3}; }
  void write_random(const std::string& out_dir, uint64_t seed, float std, DType dtype,
                    const std::string& tokenizer) const override {
    InitOptions opt;
    opt.seed = seed;
    opt.init_std = std;
    opt.dtype = dtype;
    write_random_checkpoint(cfg_, out_dir, opt);
    copy_tokenizer(tokenizer, out_dir);
  }

  double saved_bytes_per_token(const RematPolicy& keep, bool bf16, int64_t) const override {
    return model::saved_bytes_per_token(cfg_, mtp_, keep, bf16);
  }
  double step_flops(int64_t batch, int64_t seq, int64_t grad_accum) const override {
    return model::step_flops(cfg_, batch, seq, mtp_, grad_accum);
  }

  std::string training_note(const LossOptions& o) const override {
    std::string mhc;
    if (cfg_.has_mhc())
      mhc = fmt::format("mHC: {} residual streams, {} Sinkhorn iterations", cfg_.mhc_expansion_rate,
                        cfg_.mhc_sinkhorn_iterations);
    if (cfg_.has_engram()) {
      int64_t rows = 0;
      for (int64_t l : cfg_.engram_layers) rows += cfg_.engram_table_rows(l);
      mhc += fmt::format("{}Engram on layers [{}]: 2..{}-grams, {} hash heads each, {} table rows of {}",
                         mhc.empty() ? "" : "; ", fmt::join(cfg_.engram_layers, ", "), cfg_.engram_max_ngram_size,
                         cfg_.engram_num_heads, rows, cfg_.engram_head_dim);
      if (cfg_.engram_token_classes)
        mhc += fmt::format(", over {} token classes of the {} ids", cfg_.engram_class_count, cfg_.vocab_size);
    }
    if (cfg_.index_n_heads == 0) return mhc;
    return (mhc.empty() ? "" : mhc + "; ") +
           fmt::format("DSA: {}; the indexer {}",
                       o.indexer_sparse_training
                           ? fmt::format("the sparse stage, attention over the indexer's top {} keys", cfg_.index_topk)
                           : std::string("the dense warm-up, attention dense"),
                       o.indexer_loss_scaling_factor > 0
                           ? fmt::format("learns from its KL loss (x {})", o.indexer_loss_scaling_factor)
                           : std::string("is not trained (indexer_loss_scaling_factor is 0)"));
  }
  void check_loss_options(const LossOptions& o) const override {
    DS_CHECK(cfg_.index_n_heads > 0 || (!o.indexer_sparse_training && o.indexer_loss_scaling_factor == 0),
             "indexer_sparse_training and indexer_loss_scaling_factor need a model with the DSA indexer "
             "(use_indexer: true)");
  }
  bool reports_indexer_loss() const override { return cfg_.index_n_heads > 0; }

  LossOptions::Whole loss_weights(const TrainBatch& whole, bool mtp) const override {
    return model::loss_weights(whole, mtp ? mtp_ : 0);
  }

  std::unique_ptr<BoundModel> bind(float* params, float* grads) const override {
    return std::make_unique<V3Bound>(cfg_, mtp_, params, grads);
  }
  std::unique_ptr<StreamedModel> bind_streamed() const override {
    // The bound model owns the trees the leaves point into.
    struct Owner final : BoundModel {
      Owner(const ModelConfig& c, int64_t mtp)
          : view(make_params<ops::WeightView>(c, mtp)), grads(make_params<float*>(c, mtp)), inner(c, view, &grads) {}
      LossTerms loss_and_grad(const TrainBatch& b, const LossOptions& o, const RematPolicy& r, bool g) override {
        return inner.loss_and_grad(b, o, r, g);
      }
      ParamsView view;
      ModelParams<float*> grads;
      V3Bound inner;
    };
    auto owner = std::make_unique<Owner>(cfg_, mtp_);
    auto sm = std::make_unique<StreamedModel>();
    sm->leaves = tree_leaves(cfg_, mtp_, owner->view, owner->grads);
    sm->bound = std::move(owner);
    return sm;
  }

 private:
  const ModelConfig cfg_;
  const int64_t mtp_;
};

}  // namespace

TreeLeaves tree_leaves(const ModelConfig& cfg, int64_t mtp_layers, ParamsView& view, ModelParams<float*>& grads) {
  TreeLeaves l;
  for_each_param(
      cfg, mtp_layers,
      [&](const ParamInfo&, ops::WeightView& v, float*& g) {
        l.views.push_back(&v);
        l.grads.push_back(&g);
      },
      view, grads);
  if (cfg.tie_word_embeddings)
    l.after_point = [&view, &grads](int64_t u) {
      if (u != 0) return;
      view.lm_head = view.embed;
      grads.lm_head = grads.embed;
    };
  return l;
}

std::unique_ptr<Family> v3_family(const ModelConfig& cfg, int64_t mtp_layers) {
  return std::make_unique<V3Family>(cfg, mtp_layers);
}

}  // namespace ds::model
