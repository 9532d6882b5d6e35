#include "train/data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "io/text_input.h"
#include "io/token_shards.h"

namespace ds::train {

namespace {

using json = nlohmann::json;

// Upper bounds on a batch, so a typo cannot ask for an unbounded allocation.
constexpr int64_t kMaxSeq = int64_t{1} << 24;
constexpr int64_t kMaxBatchTokens = int64_t{1} << 30;

// Philox streams, so the random sources never share numbers.
constexpr uint64_t kRandomStream = 0, kCopyStream = 1, kShuffleStream = 2;

model::TrainBatch empty_batch(int64_t batch, int64_t seq) {
  model::TrainBatch b;
  b.batch = batch;
  b.seq = seq;
  const size_t n = static_cast<size_t>(batch * seq);
  b.inputs.assign(n, 0);
  b.targets.assign(n, 0);
  b.positions.assign(n, 0);
  b.segment_ids.assign(n, 0);
  b.target_segment_ids.assign(n, 0);
  return b;
}

// One row of seq + 1 tokens, each with its segment (0: padding) and position.
struct Row {
  std::vector<int32_t> tokens, segments, positions;
  explicit Row(int64_t len) : tokens(len, 0), segments(len, 0), positions(len, 0) {}
};

// Row b of `out` from a row of seq + 1 tokens: input j is token j, its target
// token j + 1. The target counts (target_segment_ids = the segment) only
// when both tokens belong to the same non-padding segment, so no prediction
// crosses from one document into the next and padding is never a target.
void emit_row(model::TrainBatch& out, int64_t b, const Row& r) {
  const int64_t T = out.seq;
  for (int64_t j = 0; j < T; ++j) {
    const size_t o = static_cast<size_t>(b * T + j);
    out.inputs[o] = r.tokens[j];
    out.targets[o] = r.tokens[j + 1];
    out.positions[o] = r.positions[j];
    out.segment_ids[o] = r.segments[j];
    out.target_segment_ids[o] = r.segments[j] != 0 && r.segments[j] == r.segments[j + 1] ? r.segments[j] : 0;
  }
}

// A non-negative integer field of a saved state.
uint64_t state_field(const json& state, const char* key, const char* type) {
  DS_CHECK(state.is_object() && state.contains(key), "data state {} for a {} dataset lacks \"{}\"", state.dump(), type,
           key);
  const json& v = state.at(key);
  DS_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0),
           "data state {}: \"{}\" must be a non-negative integer", state.dump(), key);
  return v.get<uint64_t>();
}

// {"step": n} (a bare integer is accepted too).
uint64_t step_state(const json& state, const char* type) {
  if (state.is_number_integer() && (state.is_number_unsigned() || state.get<int64_t>() >= 0))
    return state.get<uint64_t>();
  return state_field(state, "step", type);
}

// ---------------------------------------------------------------------------
// synthetic, task random: one batch drawn once from the seed, every step.

class SyntheticRandom final : public Dataset {
 public:
  explicit SyntheticRandom(const DataConfig& cfg) : batch_(empty_batch(cfg.batch, cfg.seq)) {
    const int64_t L = cfg.seq + 1;
    const Philox rng(cfg.seed, kRandomStream);
    Row r(L);
    for (int64_t j = 0; j < L; ++j) {
      r.segments[j] = 1;
      r.positions[j] = static_cast<int32_t>(j);
    }
    for (int64_t b = 0; b < cfg.batch; ++b) {
      for (int64_t j = 0; j < L; ++j)
        r.tokens[j] = static_cast<int32_t>(rng.u32(static_cast<uint64_t>(b * L + j)) % cfg.vocab_size);
      emit_row(batch_, b, r);
    }
  }
  model::TrainBatch next() override {
    ++step_;
    return batch_;
  }
  json state() const override { return {{"step", step_}}; }
  void restore(const json& s) override { step_ = step_state(s, "synthetic"); }
  void rewind() override { step_ = 0; }

 private:
  model::TrainBatch batch_;
  uint64_t step_ = 0;
};

// ---------------------------------------------------------------------------
// synthetic, task copy: row = a[0..n) a[0..n) with a fresh random a per row
// and step. For odd seq + 1 the row ends in one padding token, which is only
// ever a target and is not counted.

class SyntheticCopy final : public Dataset {
 public:
  explicit SyntheticCopy(const DataConfig& cfg) : cfg_(cfg) {}
  model::TrainBatch next() override {
    const int64_t L = cfg_.seq + 1, n = L / 2;
    const Philox rng(cfg_.seed, kCopyStream);
    model::TrainBatch out = empty_batch(cfg_.batch, cfg_.seq);
    Row r(L);
    for (int64_t j = 0; j < 2 * n; ++j) {
      r.segments[j] = 1;
      r.positions[j] = static_cast<int32_t>(j);
    }
    for (int64_t b = 0; b < cfg_.batch; ++b) {
      const uint64_t row = step_ * static_cast<uint64_t>(cfg_.batch) + static_cast<uint64_t>(b);
      for (int64_t k = 0; k < n; ++k) {
        const auto id = static_cast<int32_t>(rng.u32(row * static_cast<uint64_t>(n) + k) % cfg_.vocab_size);
        r.tokens[k] = id;
        r.tokens[n + k] = id;
      }
      emit_row(out, b, r);
    }
    ++step_;
    return out;
  }
  json state() const override { return {{"step", step_}}; }
  void restore(const json& s) override { step_ = step_state(s, "synthetic copy"); }
  void rewind() override { step_ = 0; }

 private:
  DataConfig cfg_;
  uint64_t step_ = 0;
};

// ---------------------------------------------------------------------------
// json: recorded batches, checked whole when opened.

class JsonDataset final : public Dataset {
 public:
  explicit JsonDataset(const DataConfig& cfg) : cfg_(cfg) {
    const std::string& path = cfg.dataset_path;
    json j;
    try {
      j = json::parse(io::read_file(path, "dataset"));
    } catch (const json::exception& e) {
      DS_FAIL("dataset '{}' is not valid JSON: {}", path, e.what());
    }
    DS_CHECK(j.is_array(), "dataset '{}' must be a JSON array of steps (each an array of {} rows of {} ids), got {}",
             path, cfg.batch, cfg.seq + 1, j.type_name());
    DS_CHECK(!j.empty(), "dataset '{}' is empty: it holds no steps", path);
    const int64_t L = cfg.seq + 1;
    ids_.reserve(j.size() * static_cast<size_t>(cfg.batch * L));
    for (size_t s = 0; s < j.size(); ++s) {
      const json& step = j[s];
      DS_CHECK(step.is_array() && static_cast<int64_t>(step.size()) == cfg.batch,
               "dataset '{}': step {} must be an array of batch = {} rows, got {}", path, s, cfg.batch,
               step.is_array() ? fmt::format("{} rows", step.size()) : std::string(step.type_name()));
      for (size_t r = 0; r < step.size(); ++r) {
        const json& row = step[r];
        DS_CHECK(row.is_array() && static_cast<int64_t>(row.size()) == L,
                 "dataset '{}': step {}, row {} must hold seq + 1 = {} token ids, got {}", path, s, r, L,
                 row.is_array() ? fmt::format("{} ids", row.size()) : std::string(row.type_name()));
        for (size_t c = 0; c < row.size(); ++c) {
          const json& v = row[c];
          const bool ok = v.is_number_integer() &&
                          (v.is_number_unsigned() ? v.get<uint64_t>() < static_cast<uint64_t>(cfg.vocab_size)
                                                  : v.get<int64_t>() >= 0 && v.get<int64_t>() < cfg.vocab_size);
          DS_CHECK(ok, "dataset '{}': step {}, row {}, column {}: {} is not a token id below vocab_size {}", path, s, r,
                   c, v.dump(), cfg.vocab_size);
          ids_.push_back(static_cast<int32_t>(v.get<int64_t>()));
        }
      }
    }
    steps_ = j.size();
  }
  model::TrainBatch next() override {
    DS_CHECK(step_ < steps_, "dataset '{}' exhausted after {} steps", cfg_.dataset_path, steps_);
    const int64_t L = cfg_.seq + 1;
    model::TrainBatch out = empty_batch(cfg_.batch, cfg_.seq);
    Row r(L);
    for (int64_t j = 0; j < L; ++j) {
      r.segments[j] = 1;
      r.positions[j] = static_cast<int32_t>(j);
    }
    for (int64_t b = 0; b < cfg_.batch; ++b) {
      const int32_t* src = ids_.data() + (step_ * static_cast<uint64_t>(cfg_.batch) + b) * static_cast<uint64_t>(L);
      std::copy(src, src + L, r.tokens.begin());
      emit_row(out, b, r);
    }
    ++step_;
    return out;
  }
  json state() const override { return {{"step", step_}}; }
  void restore(const json& s) override {
    const uint64_t step = step_state(s, "json");
    DS_CHECK(step <= steps_, "data state: step {} is past the end of dataset '{}' ({} steps)", step, cfg_.dataset_path,
             steps_);
    step_ = step;
  }
  void rewind() override { step_ = 0; }

 private:
  DataConfig cfg_;
  std::vector<int32_t> ids_;  // [steps, batch, seq + 1]
  uint64_t steps_ = 0, step_ = 0;
};

// ---------------------------------------------------------------------------
// tokens: documents of a prepared directory, packed into rows.

// A permutation of 0..n-1 (Fisher-Yates, Philox draws), the same on every
// machine and standard library.
std::vector<uint64_t> shuffled_order(uint64_t n, uint64_t seed) {
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), uint64_t{0});
  const Philox rng(seed, kShuffleStream);
  for (uint64_t i = n; i > 1; --i) {
    const auto w = rng.block(i);
    const uint64_t r = (static_cast<uint64_t>(w[0]) << 32) | w[1];
    std::swap(order[i - 1], order[r % i]);
  }
  return order;
}

class TokensDataset final : public Dataset {
 public:
  TokensDataset(const DataConfig& cfg, Split split)
      : cfg_(cfg),
        shuffle_(split == Split::Train),
        data_(io::TokenSplit::open(cfg.dataset_path, split == Split::Train ? "train" : "eval", cfg.vocab_size)) {
    const char* name = split == Split::Train ? "train" : "eval";
    DS_CHECK(data_.num_tokens() > 0, "token directory '{}' has no {} tokens ({} documents){}", cfg.dataset_path, name,
             data_.num_documents(), split == Split::Eval ? " (a corpus of one document has no eval split)" : "");
    set_epoch(0);
  }

  model::TrainBatch next() override {
    const int64_t L = cfg_.seq + 1;
    model::TrainBatch out = empty_batch(cfg_.batch, cfg_.seq);
    Row r(L);
    for (int64_t b = 0; b < cfg_.batch; ++b) {
      fill_row(r);
      emit_row(out, b, r);
    }
    return out;
  }

  json state() const override {
    return {{"epoch", epoch_}, {"index", index_}, {"offset", offset_}, {"documents", data_.num_documents()}};
  }

  void restore(const json& s) override {
    const uint64_t epoch = state_field(s, "epoch", "tokens"), index = state_field(s, "index", "tokens"),
                   offset = state_field(s, "offset", "tokens");
    const uint64_t n = data_.num_documents();
    if (s.contains("documents"))
      DS_CHECK(state_field(s, "documents", "tokens") == n,
               "data state {} was saved for a split of {} documents, but '{}' has {}", s.dump(), s["documents"].dump(),
               cfg_.dataset_path, n);
    DS_CHECK(index < n, "data state {}: document index {} is outside the {} documents of '{}'", s.dump(), index, n,
             cfg_.dataset_path);
    // Everything is checked before anything changes.
    std::vector<uint64_t> order;
    if (shuffle_) order = shuffled_order(n, cfg_.seed + epoch);
    const uint64_t len = data_.document(shuffle_ ? order[index] : index).size();
    DS_CHECK(offset == 0 || offset < len, "data state {}: offset {} is outside document {} of {} tokens", s.dump(),
             offset, index, len);
    epoch_ = epoch;
    order_ = std::move(order);
    index_ = index;
    offset_ = offset;
  }

  void rewind() override {
    set_epoch(0);
    index_ = 0;
    offset_ = 0;
  }

  // Rows that hold every token once (packed: the tokens fill rows end to
  // end; unpacked: each document's pieces), in batches.
  int64_t batches_per_pass() const override {
    const auto L = static_cast<uint64_t>(cfg_.seq + 1);
    uint64_t rows = 0;
    if (cfg_.packing) {
      rows = (data_.num_tokens() + L - 1) / L;
    } else {
      for (uint64_t i = 0; i < data_.num_documents(); ++i) rows += (data_.document(i).size() + L - 1) / L;
    }
    return static_cast<int64_t>((rows + static_cast<uint64_t>(cfg_.batch) - 1) / static_cast<uint64_t>(cfg_.batch));
  }

 private:
  // The document at place i of this epoch's order.
  std::span<const uint32_t> document(uint64_t i) const { return data_.document(shuffle_ ? order_[i] : i); }

  void set_epoch(uint64_t e) {
    epoch_ = e;
    // Train: a fresh order per epoch, shuffled with seed + epoch. Eval: the
    // stored order every pass.
    if (shuffle_) order_ = shuffled_order(data_.num_documents(), cfg_.seed + e);
  }

  void next_document() {
    offset_ = 0;
    if (++index_ == data_.num_documents()) {
      index_ = 0;
      set_epoch(epoch_ + 1);
    }
  }

  // Greedy packing: documents in order fill the row; one that does not fit
  // is cut, and its rest starts the next row. Positions count from 0 within
  // each piece of a document in a row (a continued document starts again at
  // 0 in the next row), so they stay below seq + 1. Empty documents are
  // skipped. Without packing a row holds one piece, then padding.
  void fill_row(Row& r) {
    const int64_t L = static_cast<int64_t>(r.tokens.size());
    int64_t j = 0;
    int32_t seg = 0;
    while (j < L) {
      const auto doc = document(index_);
      const uint64_t left = doc.size() - offset_;
      if (left == 0) {
        next_document();
        continue;
      }
      const int64_t take = static_cast<int64_t>(std::min<uint64_t>(left, static_cast<uint64_t>(L - j)));
      ++seg;
      for (int64_t t = 0; t < take; ++t) {
        r.tokens[j + t] = static_cast<int32_t>(doc[offset_ + t]);
        r.segments[j + t] = seg;
        r.positions[j + t] = static_cast<int32_t>(t);
      }
      j += take;
      offset_ += static_cast<uint64_t>(take);
      if (offset_ == doc.size()) next_document();
      if (!cfg_.packing) break;
    }
    for (; j < L; ++j) {
      r.tokens[j] = 0;
      r.segments[j] = 0;
      r.positions[j] = 0;
    }
  }

  DataConfig cfg_;
  bool shuffle_;
  io::TokenSplit data_;
  std::vector<uint64_t> order_;  // Train: this epoch's document order
  uint64_t epoch_ = 0, index_ = 0, offset_ = 0;
};

}  // namespace

std::unique_ptr<Dataset> open_dataset(const DataConfig& cfg, Split split) {
  DS_CHECK(cfg.batch >= 1, "data: batch (rows per step) must be at least 1, got {}", cfg.batch);
  DS_CHECK(cfg.seq >= 1 && cfg.seq <= kMaxSeq, "data: seq (tokens per row) must be in [1, {}], got {}", kMaxSeq,
           cfg.seq);
  DS_CHECK(cfg.batch <= kMaxBatchTokens / (cfg.seq + 1), "data: {} rows of {} tokens is more than {} tokens per step",
           cfg.batch, cfg.seq + 1, kMaxBatchTokens);
  DS_CHECK(cfg.vocab_size >= 1 && cfg.vocab_size <= (int64_t{1} << 31), "data: vocab_size must be in [1, 2^31], got {}",
           cfg.vocab_size);
  const bool eval = split == Split::Eval;
  const std::string& type = cfg.dataset_type;
  if (type == "synthetic") {
    DS_CHECK(!eval, "dataset_type=synthetic has no eval split (only dataset_type=tokens has one)");
    if (cfg.synthetic_task == "random") return std::make_unique<SyntheticRandom>(cfg);
    if (cfg.synthetic_task == "copy") return std::make_unique<SyntheticCopy>(cfg);
    DS_FAIL("unknown synthetic_task '{}' (expected random or copy)", cfg.synthetic_task);
  }
  if (type != "json" && type != "tokens")
    DS_FAIL("unknown dataset_type '{}' (expected synthetic, json or tokens)", type);
  DS_CHECK(!eval || type == "tokens", "dataset_type={} has no eval split (only dataset_type=tokens has one)", type);
  DS_CHECK(!cfg.dataset_path.empty(), "dataset_type={} needs dataset_path ({})", type,
           type == "json" ? "a JSON file of batches" : "a directory written by `deepseek prepare`");
  std::error_code ec;
  DS_CHECK(std::filesystem::exists(cfg.dataset_path, ec), "dataset_path '{}' does not exist", cfg.dataset_path);
  if (type == "json") {
    DS_CHECK(!std::filesystem::is_directory(cfg.dataset_path, ec),
             "dataset_path '{}' is a directory; dataset_type=json reads one JSON file", cfg.dataset_path);
    return std::make_unique<JsonDataset>(cfg);
  }
  return std::make_unique<TokensDataset>(cfg, split);
}

}  // namespace ds::train
