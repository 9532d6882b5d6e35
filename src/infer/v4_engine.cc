#include "infer/v4_engine.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/system.h"

namespace ds::infer {

namespace fs = std::filesystem;

bool is_v4_folder(const std::string& dir) {
  const fs::path p = fs::path(dir) / "config.json";
  return fs::is_regular_file(p) && model::is_v4_model_type(model::config_model_type(p.string()));
}

model::V4Config load_v4_config(const std::string& dir) {
  DS_CHECK(fs::is_directory(dir), "model folder '{}' does not exist or is not a folder", dir);
  model::V4Config c = model::V4Config::from_hf_json_file((fs::path(dir) / "config.json").string());
  if (!c.engram_layers.empty()) {  // V4.1's Engram hashes the tokenizer's token classes
    const fs::path tok = fs::path(dir) / "tokenizer.json";
    DS_CHECK(fs::is_regular_file(tok),
             "model folder '{}': its Engram layers hash the tokenizer's token classes, and it has no tokenizer.json",
             dir);
    c.attach_engram_classes(tok.string());
  }
  return c;
}

std::unique_ptr<LoadedV4Model> load_v4_model(const std::string& dir, model::V4Options opt) {
  auto m = std::make_unique<LoadedV4Model>();
  m->config = load_v4_config(dir);
  m->files = io::SafetensorsSet::open_dir(dir);
  m->config.num_nextn_predict_layers = model::v4_stored_mtp_layers(m->files, m->config);
  m->weights = model::V4Weights::load(m->files, m->config);
  opt.release_engram_pages = true;  // the tables are the folder's file mappings
  m->model = std::make_unique<model::V4Model>(m->config, m->weights.view, opt);
  return m;
}

void check_v4_request(const model::V4Config& cfg, const std::vector<int64_t>& prompt_lengths,
                      const GenerateOptions& opt, bool codes) {
  check_generate_options(cfg.vocab_size, cfg.max_position_embeddings, prompt_lengths, opt);
  size_t bytes = 0;
  for (const int64_t n : prompt_lengths)
    bytes += model::v4_state_bytes(
        cfg, std::min(n + std::max<int64_t>(opt.max_new_tokens - 1, 0), cfg.max_position_embeddings), codes);
  check_fits_in_memory(static_cast<int64_t>(bytes), "the attention state of this request");
}

void V4Decoder::start(int64_t sequences) {
  states_.clear();
  for (int64_t s = 0; s < sequences; ++s) states_.push_back(m_.new_state());
}

void V4Decoder::reset(int64_t s) {
  DS_CHECK(s >= 0 && s < static_cast<int64_t>(states_.size()), "reset: no sequence {}", s);
  states_[static_cast<size_t>(s)] = m_.new_state();
}

std::vector<float> V4Decoder::run(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) {
  DS_CHECK(tokens.size() == states_.size(), "V4 step: {} token lists for {} sequences", tokens.size(), states_.size());
  std::vector<model::V4Request> batch;
  for (size_t s = 0; s < tokens.size(); ++s)
    if (!tokens[s].empty()) batch.push_back({&states_[s], tokens[s].data(), static_cast<int64_t>(tokens[s].size())});
  return m_.forward(batch, all_logits);
}

std::vector<float> V4Decoder::step(const std::vector<std::vector<int32_t>>& tokens) { return run(tokens, false); }

void V4Decoder::copy(int64_t from, int64_t to) {
  const int64_t S = static_cast<int64_t>(states_.size());
  DS_CHECK(from >= 0 && from < S && to >= 0 && to < S, "copy: no sequence {} or {}", from, to);
  if (from != to) states_[static_cast<size_t>(to)] = states_[static_cast<size_t>(from)];
}

std::vector<float> V4Decoder::step_all(const std::vector<std::vector<int32_t>>& tokens) { return run(tokens, true); }

namespace {

struct V4Snapshot final : CacheSnapshot {
  explicit V4Snapshot(model::V4State s) : state(std::move(s)) {}
  int64_t length() const override { return state.length; }
  size_t bytes() const override { return state.bytes(); }
  model::V4State state;
};

}  // namespace

size_t V4Decoder::bytes_after(int64_t s, int64_t n) const {
  const auto& st = states_[static_cast<size_t>(s)];
  return std::max(st.bytes(), model::v4_state_bytes(m_.config(), st.length + n, m_.options().qat));
}

size_t V4Decoder::bytes_for(int64_t tokens) const {
  return model::v4_state_bytes(m_.config(), tokens, m_.options().qat);
}

std::shared_ptr<const CacheSnapshot> V4Decoder::take_snapshot(int64_t s) {
  DS_CHECK(s >= 0 && s < static_cast<int64_t>(states_.size()), "take_snapshot: no sequence {}", s);
  auto snap = std::make_shared<V4Snapshot>(std::move(states_[static_cast<size_t>(s)]));
  states_[static_cast<size_t>(s)] = m_.new_state();
  return snap;
}

int64_t V4Decoder::restorable(const CacheSnapshot& snap, int64_t want) const {
  const auto* v = dynamic_cast<const V4Snapshot*>(&snap);
  return v && v->state.length > 0 && want >= v->state.length ? v->state.length : 0;
}

void V4Decoder::restore(int64_t s, const CacheSnapshot& snap, int64_t length) {
  DS_CHECK(restorable(snap, length) == length, "restore: a V4 state is restored whole ({} positions, not {})",
           snap.length(), length);
  DS_CHECK(states_[static_cast<size_t>(s)].length == 0, "restore: sequence {} is not empty", s);
  states_[static_cast<size_t>(s)] = dynamic_cast<const V4Snapshot&>(snap).state;
}

size_t V4Decoder::cache_bytes() const {
  size_t b = 0;
  for (const auto& s : states_) b += s.bytes();
  return b;
}

}  // namespace ds::infer
