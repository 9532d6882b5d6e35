// DeepSeek-V4's face to generation (infer/model.h): its per-sequence states
// behind the common generation loop (infer/v4_engine.h).
#include "core/error.h"
#include "infer/model.h"
#include "infer/v4_engine.h"
#include "model/flops.h"

namespace ds::infer {

namespace {

// DeepSeek-V4: its per-sequence attention state.
class V4Model final : public Model {
 public:
  V4Model(const std::string& dir, const ModelOptions& opt) : dir_(dir), opt_(opt), cfg_(load_v4_config(dir)) {
    DS_CHECK(!opt.late_index_keys || cfg_.v41(), "--late-index-keys applies to DeepSeek-V4.1 models only");
  }

  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t eos_token_id() const override { return cfg_.eos_token_id; }
  int64_t max_positions() const override { return cfg_.max_position_embeddings; }
  void check(const std::vector<int64_t>& lengths, const GenerateOptions& opt) const override {
    check_v4_request(cfg_, lengths, opt, /*codes=*/opt_.quant_sim, opt_.mtp);
  }
  std::string cache_name(CacheKind) const override { return cfg_.v41() ? "deepseek_v41" : "deepseek_v4"; }
  std::string attention_name() const override { return cfg_.v41() ? "deepseek_v41" : "deepseek_v4"; }
  double forward_flops(int64_t batch, int64_t seq, int64_t head_rows) const override {
    return model::v4_forward_flops(cfg_, batch, seq, head_rows);
  }
  void set_dense_attention(bool dense) override {
    DS_CHECK(!dense,
             "--dense-attention compares DeepSeek-V3.2 sparse attention with dense attention; this model has no "
             "indexer");
  }

  void load() override {
    model::V4Options o;
    o.qat = opt_.quant_sim;
    o.late_index_keys = opt_.late_index_keys;
    m_ = load_v4_model(dir_, o);
    decoder_ = std::make_unique<V4Decoder>(v4(), opt_.mtp);
  }
  std::unique_ptr<Decoder> new_decoder(CacheKind) override { return std::make_unique<V4Decoder>(v4(), opt_.mtp); }
  std::vector<float> logits(const std::vector<int32_t>& ids, int64_t prefix, CacheKind,
                            std::vector<float>* mtp) override {
    if (mtp) mtp->clear();
    const int64_t T = static_cast<int64_t>(ids.size());
    model::V4State st = v4().new_state();
    std::vector<float> out;
    if (mtp && prefix == 0 && cfg_.num_nextn_predict_layers == 1 && T >= 2)
      out = v4().forward({{&st, ids.data(), T}}, true, nullptr, mtp);  // the MTP layer's logits too
    else
      out = v4().forward(st, ids.data(), prefix > 0 ? prefix : T, true);
    for (int64_t t = prefix > 0 ? prefix : T; t < T; ++t) {
      auto one = v4().forward(st, ids.data() + t, 1, true);
      out.insert(out.end(), one.begin(), one.end());
    }
    return out;
  }
  std::vector<std::vector<int32_t>> generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const GenerateOptions& opt, GenerateStats* stats) override {
    DS_CHECK(decoder_, "internal: the model's weights are not loaded");
    return infer::generate(*decoder_, prompts, opt, stats);
  }

 private:
  model::V4Model& v4() {
    DS_CHECK(m_, "internal: the model's weights are not loaded");
    return *m_->model;
  }

  const std::string dir_;
  const ModelOptions opt_;
  const model::V4Config cfg_;
  std::unique_ptr<LoadedV4Model> m_;
  std::unique_ptr<V4Decoder> decoder_;
};

}  // namespace

std::unique_ptr<Model> open_v4_model(const std::string& dir, const ModelOptions& opt) {
  return std::make_unique<V4Model>(dir, opt);
}

}  // namespace ds::infer
