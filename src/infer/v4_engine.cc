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
                      const GenerateOptions& opt, bool codes, bool mtp) {
  check_generate_options(cfg.vocab_size, cfg.max_position_embeddings, prompt_lengths, opt);
  size_t bytes = 0;
  for (const int64_t n : prompt_lengths) {
    const int64_t tokens = std::min(n + std::max<int64_t>(opt.max_new_tokens - 1, 0), cfg.max_position_embeddings);
    bytes += model::v4_state_bytes(cfg, tokens, codes, mtp ? tokens : 0);
  }
  check_fits_in_memory(static_cast<int64_t>(bytes), "the attention state of this request");
}

V4Decoder::V4Decoder(model::V4Model& m, bool mtp) : m_(m), mtp_(mtp) {
  DS_CHECK(!mtp || m.config().num_nextn_predict_layers == 1,
           "--speculative mtp drafts with the model's MTP layer, and this model has {} (num_nextn_predict_layers)",
           m.config().num_nextn_predict_layers);
}

void V4Decoder::start(int64_t sequences) {
  states_.clear();
  for (int64_t s = 0; s < sequences; ++s) states_.push_back(m_.new_state());
  extra_.assign(static_cast<size_t>(sequences), {});
}

void V4Decoder::check_sequence(int64_t s, const char* what) const {
  DS_CHECK(s >= 0 && s < static_cast<int64_t>(states_.size()), "{}: no sequence {}", what, s);
}

void V4Decoder::reset(int64_t s) {
  check_sequence(s, "reset");
  states_[static_cast<size_t>(s)] = m_.new_state();
  extra_[static_cast<size_t>(s)] = {};
}

int64_t V4Decoder::row_width() const { return m_.config().hc_mult * m_.config().hidden_size; }

size_t V4Decoder::Drafting::bytes() const {
  size_t slots = 0;
  for (const auto* mk : {&step, &chain})
    for (const auto& l : mk->layers) slots += l.slots.capacity();
  return (kept.capacity() + link.capacity() + slots) * sizeof(float);
}

std::vector<float> V4Decoder::run(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) {
  DS_CHECK(tokens.size() == states_.size(), "V4 step: {} token lists for {} sequences", tokens.size(), states_.size());
  std::vector<model::V4Request> batch;
  for (size_t s = 0; s < tokens.size(); ++s)
    if (!tokens[s].empty()) {
      if (extra_[s].marked) {  // a plain step: the last one can no longer be undone
        model::v4_settle(states_[s]);
        extra_[s].marked = false;
      }
      batch.push_back({&states_[s], tokens[s].data(), static_cast<int64_t>(tokens[s].size())});
    }
  return m_.forward(batch, all_logits);
}

std::vector<float> V4Decoder::step(const std::vector<std::vector<int32_t>>& tokens) { return run(tokens, false); }

void V4Decoder::copy(int64_t from, int64_t to) {
  const int64_t S = static_cast<int64_t>(states_.size());
  DS_CHECK(from >= 0 && from < S && to >= 0 && to < S, "copy: no sequence {} or {}", from, to);
  if (from == to) return;
  states_[static_cast<size_t>(to)] = states_[static_cast<size_t>(from)];
  extra_[static_cast<size_t>(to)] = extra_[static_cast<size_t>(from)];
}

std::vector<float> V4Decoder::step_all(const std::vector<std::vector<int32_t>>& tokens) { return run(tokens, true); }

namespace {

struct V4Snapshot final : CacheSnapshot {
  explicit V4Snapshot(model::V4State s) : state(std::move(s)) {}
  int64_t length() const override { return state.length; }
  size_t bytes() const override { return state.bytes() + kept.capacity() * sizeof(float); }
  model::V4State state;
  // With the MTP layer: the streams of the positions it has not read, and how many it has.
  std::vector<float> kept;
  int64_t drafted = 0;
};

}  // namespace

size_t V4Decoder::mark_bytes() const {
  // The window rows of a checking step (every main layer) and of a chain of drafts (the MTP layer).
  const auto& c = m_.config();
  return static_cast<size_t>(((kMaxDraftTokens + 1) * c.num_hidden_layers + kMaxDraftTokens) * c.head_dim) *
         sizeof(float);
}

size_t V4Decoder::bytes_after(int64_t s, int64_t n) const {
  const auto& st = states_[static_cast<size_t>(s)];
  const auto& x = extra_[static_cast<size_t>(s)];
  if (!mtp_) return std::max(st.bytes(), model::v4_state_bytes(m_.config(), st.length + n, m_.options().qat));
  // A step also reads its drafts, and the MTP layer chains at most
  // kMaxDraftTokens links past what it has read.
  const int64_t to = st.length + n + kMaxDraftTokens;
  size_t b = std::max(st.bytes(), model::v4_state_bytes(m_.config(), to, m_.options().qat, to + kMaxDraftTokens));
  // The streams kept for the MTP layer (a vector grows by doubling).
  const size_t cap = x.kept.capacity(), need = x.kept.size() + static_cast<size_t>((n + kMaxDraftTokens) * row_width());
  b += (need > cap ? std::max(2 * cap, need) : cap) * sizeof(float);
  return b + static_cast<size_t>(row_width()) * sizeof(float) + mark_bytes();
}

size_t V4Decoder::bytes_for(int64_t tokens) const {
  if (!mtp_) return model::v4_state_bytes(m_.config(), tokens, m_.options().qat);
  const int64_t to = tokens + kMaxDraftTokens;
  return model::v4_state_bytes(m_.config(), to, m_.options().qat, to + kMaxDraftTokens) +
         static_cast<size_t>((to + 1) * row_width()) * sizeof(float) + mark_bytes();
}

size_t V4Decoder::sequence_bytes(int64_t s) const {
  return states_[static_cast<size_t>(s)].bytes() + extra_[static_cast<size_t>(s)].bytes();
}

std::shared_ptr<const CacheSnapshot> V4Decoder::take_snapshot(int64_t s) {
  check_sequence(s, "take_snapshot");
  auto& x = extra_[static_cast<size_t>(s)];
  if (x.links != 0) return nullptr;  // chained drafts in the MTP layer's state
  model::v4_settle(states_[static_cast<size_t>(s)]);
  auto snap = std::make_shared<V4Snapshot>(std::move(states_[static_cast<size_t>(s)]));
  snap->kept = std::move(x.kept);
  snap->kept.shrink_to_fit();
  snap->drafted = x.drafted;
  reset(s);
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
  const auto& v = dynamic_cast<const V4Snapshot&>(snap);
  states_[static_cast<size_t>(s)] = v.state;
  extra_[static_cast<size_t>(s)] = {};
  extra_[static_cast<size_t>(s)].kept = v.kept;
  extra_[static_cast<size_t>(s)].drafted = v.drafted;
}

std::vector<float> V4Decoder::step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) {
  DS_CHECK(mtp_, "this model's MTP layer is not loaded");
  DS_CHECK(tokens.size() == states_.size(), "V4 step: {} token lists for {} sequences", tokens.size(), states_.size());
  const int64_t L = m_.config().num_hidden_layers, W = m_.config().sliding_window;
  std::vector<model::V4Request> batch;
  for (size_t s = 0; s < tokens.size(); ++s) {
    if (tokens[s].empty()) continue;
    auto& st = states_[s];
    auto& x = extra_[s];
    const int64_t n = static_cast<int64_t>(tokens[s].size());
    // A step short enough to check drafts can be undone; a prompt's chunk
    // is never cut.
    x.marked = n <= std::min(kMaxDraftTokens + 1, W);
    if (x.marked) {
      x.step = m_.mark(st, 0, L, st.length, n);
      x.step_ids = tokens[s];
    } else {
      model::v4_settle(st);
      x.step = {};
    }
    batch.push_back({&st, tokens[s].data(), n});
  }
  std::vector<float> hidden;
  auto logits = m_.forward_keep(batch, all_logits, &hidden);
  const size_t D = static_cast<size_t>(row_width());
  size_t row = 0;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const size_t n = tokens[s].size();
    extra_[s].kept.insert(extra_[s].kept.end(), hidden.begin() + static_cast<std::ptrdiff_t>(row * D),
                          hidden.begin() + static_cast<std::ptrdiff_t>((row + n) * D));
    row += n;
  }
  return logits;
}

std::vector<float> V4Decoder::draft(const std::vector<std::vector<int32_t>>& next) {
  DS_CHECK(mtp_, "this model's MTP layer is not loaded");
  DS_CHECK(next.size() == states_.size(), "draft: {} token lists for {} sequences", next.size(), states_.size());
  drop_links();
  const size_t D = static_cast<size_t>(row_width());
  std::vector<model::V4DraftRequest> batch;
  for (size_t s = 0; s < next.size(); ++s) {
    auto& x = extra_[s];
    DS_CHECK(next[s].size() * D <= x.kept.size(), "draft: sequence {} keeps {} positions, {} tokens given", s,
             x.kept.size() / D, next[s].size());
    if (!next[s].empty())
      batch.push_back({&states_[s], x.kept.data(), next[s].data(), x.drafted, static_cast<int64_t>(next[s].size())});
  }
  std::vector<float> last;
  auto logits = m_.draft(batch, &last);
  size_t r = 0;
  for (size_t s = 0; s < next.size(); ++s) {
    if (next[s].empty()) continue;
    auto& x = extra_[s];
    x.kept.erase(x.kept.begin(), x.kept.begin() + static_cast<std::ptrdiff_t>(next[s].size() * D));
    x.drafted += static_cast<int64_t>(next[s].size());
    x.link.assign(last.begin() + static_cast<std::ptrdiff_t>(r * D),
                  last.begin() + static_cast<std::ptrdiff_t>((r + 1) * D));
    ++r;
  }
  return logits;
}

std::vector<float> V4Decoder::draft_more(const std::vector<int32_t>& tokens) {
  DS_CHECK(mtp_, "this model's MTP layer is not loaded");
  DS_CHECK(tokens.size() == states_.size(), "draft_more: {} tokens for {} sequences", tokens.size(), states_.size());
  const int64_t L = m_.config().num_hidden_layers;
  const size_t D = static_cast<size_t>(row_width());
  std::vector<model::V4DraftRequest> batch;
  for (size_t s = 0; s < tokens.size(); ++s) {
    if (tokens[s] < 0) continue;
    auto& x = extra_[s];
    DS_CHECK(x.link.size() == D, "draft_more: sequence {} has no draft to chain from", s);
    DS_CHECK(x.links < kMaxDraftTokens, "draft_more: sequence {} already chains {} drafts", s, x.links);
    if (x.links == 0)
      x.chain = m_.mark(states_[s], L, L + 1, x.drafted, std::min(kMaxDraftTokens, m_.config().sliding_window));
    batch.push_back({&states_[s], x.link.data(), &tokens[s], x.drafted + x.links, 1});
  }
  std::vector<float> last;
  auto logits = m_.draft(batch, &last);
  size_t r = 0;
  for (size_t s = 0; s < tokens.size(); ++s) {
    if (tokens[s] < 0) continue;
    auto& x = extra_[s];
    x.link.assign(last.begin() + static_cast<std::ptrdiff_t>(r * D),
                  last.begin() + static_cast<std::ptrdiff_t>((r + 1) * D));
    ++x.links;
    ++r;
  }
  return logits;
}

void V4Decoder::drop_links() {
  for (size_t s = 0; s < extra_.size(); ++s) {
    auto& x = extra_[s];
    if (x.links == 0) continue;
    m_.rewind(states_[s], x.chain, x.drafted + x.links, x.drafted, nullptr);
    x.links = 0;
    x.chain = {};
  }
}

void V4Decoder::truncate(int64_t s, int64_t length) {
  check_sequence(s, "truncate");
  auto& st = states_[static_cast<size_t>(s)];
  auto& x = extra_[static_cast<size_t>(s)];
  const size_t D = static_cast<size_t>(row_width()), drop = static_cast<size_t>(st.length - length);
  DS_CHECK(
      x.marked && length >= x.step.start && length <= st.length && length >= x.drafted && drop * D <= x.kept.size(),
      "truncate: sequence {} of {} tokens ({} drafted from, its last step from {}) to {}", s, st.length, x.drafted,
      x.marked ? x.step.start : st.length, length);
  m_.rewind(st, x.step, st.length, length, x.step_ids.data());
  x.kept.resize(x.kept.size() - drop * D);
  x.marked = false;
  x.step = {};
}

size_t V4Decoder::cache_bytes() const {
  size_t b = 0;
  for (const auto& s : states_) b += s.bytes();
  return b;
}

}  // namespace ds::infer
