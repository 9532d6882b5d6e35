// DeepSeek-V2/V3/V3.2's face to generation (infer/model.h): the engine over
// a KV cache (infer/engine.h).
#include "core/error.h"
#include "infer/engine.h"
#include "infer/model.h"
#include "model/flops.h"
#include "model/load.h"

namespace ds::infer {

namespace {

// DeepSeek-V2/V3/V3.2: the engine over a KV cache (latent or naive).
class V3Model final : public Model {
 public:
  V3Model(const std::string& dir, const ModelOptions& opt) : dir_(dir), cfg_(model::load_config(dir)), mtp_(opt.mtp) {
    DS_CHECK(opt.quant_sim, "--no-quant-sim applies to DeepSeek-V4 models only");
    DS_CHECK(!opt.late_index_keys, "--late-index-keys applies to DeepSeek-V4.1 models only");
    DS_CHECK(!mtp_ || cfg_.num_nextn_predict_layers > 0,
             "--speculative mtp drafts with the model's MTP layer, and this model has none (num_nextn_predict_layers "
             "0)");
    DS_CHECK(!mtp_ || cfg_.mhc_expansion_rate <= 1, "--speculative mtp: an mHC model has no MTP layer");
  }

  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t eos_token_id() const override { return cfg_.eos_token_id; }
  int64_t max_positions() const override { return cfg_.max_position_embeddings; }
  void check(const std::vector<int64_t>& lengths, const GenerateOptions& opt) const override {
    check_generate_request(cfg_, lengths, opt);
  }
  std::string cache_name(CacheKind kind) const override { return kind == CacheKind::Naive ? "naive" : "latent"; }
  std::string attention_name() const override { return cfg_.index_n_heads == 0 ? "mla" : dense_ ? "dense" : "sparse"; }
  double forward_flops(int64_t batch, int64_t seq, int64_t head_rows) const override {
    return model::forward_flops(cfg_, batch, seq, head_rows);
  }
  void set_dense_attention(bool dense) override {
    DS_CHECK(!dense || cfg_.index_n_heads > 0,
             "--dense-attention compares DeepSeek-V3.2 sparse attention with dense attention; this model has no "
             "indexer");
    dense_ = dense;
    if (m_) m_->engine->set_dense_attention(dense);
  }

  void load() override {
    m_ = load_model(dir_, mtp_);
    m_->engine->set_dense_attention(dense_);
  }
  std::unique_ptr<Decoder> new_decoder(CacheKind kind) override { return kv_decoder(engine(), kind); }
  std::vector<float> logits(const std::vector<int32_t>& ids, int64_t prefix, CacheKind kind,
                            std::vector<float>* mtp) override {
    if (mtp) mtp->clear();
    const int64_t T = static_cast<int64_t>(ids.size());
    const int64_t first = prefix > 0 ? prefix : T;
    KvCache cache(kind, 1, cfg_.num_hidden_layers);
    auto out = engine().step(cache, {{ids.begin(), ids.begin() + first}}, /*all_logits=*/true);
    for (int64_t t = first; t < T; ++t) {
      auto one = engine().step(cache, {{ids[static_cast<size_t>(t)]}}, true);
      out.insert(out.end(), one.begin(), one.end());
    }
    return out;
  }
  std::vector<std::vector<int32_t>> generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const GenerateOptions& opt, GenerateStats* stats) override {
    return infer::generate(engine(), prompts, opt, stats);
  }

 private:
  Engine& engine() {
    DS_CHECK(m_, "internal: the model's weights are not loaded");
    return *m_->engine;
  }

  const std::string dir_;
  const model::ModelConfig cfg_;
  std::unique_ptr<LoadedModel> m_;
  bool dense_ = false;
  const bool mtp_;
};

}  // namespace

std::unique_ptr<Model> open_v3_model(const std::string& dir, const ModelOptions& opt) {
  return std::make_unique<V3Model>(dir, opt);
}

}  // namespace ds::infer
