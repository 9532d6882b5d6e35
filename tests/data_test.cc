// Training data: the token-shard format (round trip, every kind of damage
// rejected), the packing of documents into rows (every token once per epoch,
// segments and positions per document, no counted target across documents),
// resumable state, and the synthetic and json datasets.
#include "train/data.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/token_shards.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"

namespace ds {
namespace {
namespace data_test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using train::DataConfig;
using train::Split;

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("ds_data_test") {}
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Token ids that say where they come from: document d, token k -> d * 64 + k + 1
// (0 stays free for padding).
constexpr int64_t kStride = 64;
int32_t id_of(int64_t doc, int64_t k) { return static_cast<int32_t>(doc * kStride + k + 1); }
int64_t doc_of(int32_t id) { return (id - 1) / kStride; }
int64_t pos_of(int32_t id) { return (id - 1) % kStride; }

std::vector<int32_t> make_doc(int64_t d, int64_t len) {
  std::vector<int32_t> v;
  for (int64_t k = 0; k < len; ++k) v.push_back(id_of(d, k));
  return v;
}

// A corpus of `train_lens.size()` train and `eval_lens.size()` eval documents
// (eval documents numbered after the train ones), cut into shards of at most
// `shard_tokens` tokens.
struct Corpus {
  TempDir dir;
  std::vector<int64_t> train_lens, eval_lens;
  int64_t vocab = 0;
};
void write_corpus(Corpus& c, uint64_t shard_tokens = 40) {
  c.vocab = static_cast<int64_t>(c.train_lens.size() + c.eval_lens.size()) * kStride + 1;
  io::TokenCorpusWriter w(c.dir.path(), shard_tokens, c.vocab);
  for (size_t d = 0; d < c.train_lens.size(); ++d) w.add("train", make_doc(static_cast<int64_t>(d), c.train_lens[d]));
  for (size_t d = 0; d < c.eval_lens.size(); ++d)
    w.add("eval", make_doc(static_cast<int64_t>(c.train_lens.size() + d), c.eval_lens[d]));
  io::TokenCorpusMeta meta;
  meta.tokenizer = "tokenizer.json";
  w.finish(meta);
}

DataConfig tokens_config(const Corpus& c, int64_t batch, int64_t seq, uint64_t seed = 0) {
  DataConfig cfg;
  cfg.dataset_type = "tokens";
  cfg.dataset_path = c.dir.path();
  cfg.batch = batch;
  cfg.seq = seq;
  cfg.vocab_size = c.vocab;
  cfg.seed = seed;
  return cfg;
}

bool same(const model::TrainBatch& a, const model::TrainBatch& b) {
  return a.batch == b.batch && a.seq == b.seq && a.inputs == b.inputs && a.targets == b.targets &&
         a.positions == b.positions && a.segment_ids == b.segment_ids && a.target_segment_ids == b.target_segment_ids;
}

// The model's own check: shapes, ids below vocab, positions below seq.
void model_check(const model::TrainBatch& b, int64_t vocab) {
  model::ModelConfig cfg;
  cfg.vocab_size = vocab;
  cfg.max_position_embeddings = b.seq;
  b.check(cfg);
}

// ---------------------------------------------------------------------------
// Shards

TEST(TokenShards, RoundTrip) {
  TempDir dir;
  const std::vector<uint64_t> offsets = {0, 3, 3, 7};  // the second document is empty
  const std::vector<uint32_t> tokens = {5, 6, 7, 1, 2, 3, 4294967295u};
  const std::string path = dir / "train-00000.tok";
  io::write_token_shard(path, offsets, tokens);
  EXPECT_EQ(fs::file_size(path), 32u + 8u * 4u + 4u * 7u);
  const auto s = io::TokenShard::open(path);
  EXPECT_EQ(s.num_documents(), 3u);
  EXPECT_EQ(s.num_tokens(), 7u);
  EXPECT_EQ(std::vector<uint64_t>(s.offsets().begin(), s.offsets().end()), offsets);
  EXPECT_EQ(std::vector<uint32_t>(s.tokens().begin(), s.tokens().end()), tokens);
  EXPECT_EQ(std::vector<uint32_t>(s.document(0).begin(), s.document(0).end()), (std::vector<uint32_t>{5, 6, 7}));
  EXPECT_TRUE(s.document(1).empty());
  EXPECT_EQ(s.document(2).size(), 4u);
  // The header is the documented one, little-endian.
  const std::string bytes = read_bytes(path);
  EXPECT_EQ(bytes.substr(0, 8), "DSTOKEN1");
  EXPECT_EQ(static_cast<unsigned char>(bytes[16]), 3);  // document count
  EXPECT_EQ(static_cast<unsigned char>(bytes[24]), 7);  // token count
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1) << "no temporary left";
  expect_error([&] { io::TokenShard::open(path, 1000); }, "id 4294967295, not below the vocabulary size 1000");
  expect_error(
      [&] {
        io::write_token_shard(dir / "bad.tok", std::vector<uint64_t>{0, 4, 2}, tokens);
      },
      "offsets must run from 0");
}

TEST(TokenShards, DamageIsRejectedWithOneClearError) {
  TempDir dir;
  const std::string good = dir / "good.tok";
  io::write_token_shard(good, std::vector<uint64_t>{0, 2, 5}, std::vector<uint32_t>{1, 2, 3, 4, 5});
  const std::string bytes = read_bytes(good);
  const std::string bad = dir / "bad.tok";
  auto with = [&](const std::string& b) {
    write_bytes(bad, b);
    return bad;
  };
  auto patch = [&](size_t at, uint64_t v, size_t n) {
    std::string b = bytes;
    std::memcpy(b.data() + at, &v, n);
    return b;
  };
  expect_error([&] { io::TokenShard::open(with(bytes.substr(0, 20))); }, "shorter than the 32-byte header");
  expect_error([&] { io::TokenShard::open(with(bytes.substr(0, bytes.size() - 1))); },
               "promises 2 documents and 5 tokens (truncated or corrupt)");
  expect_error([&] { io::TokenShard::open(with(bytes + "xxxx")); }, "truncated or corrupt");
  expect_error([&] { io::TokenShard::open(with("NOTATOKN" + bytes.substr(8))); }, "bad magic bytes");
  expect_error([&] { io::TokenShard::open(with(patch(8, 2, 4))); }, "format version 2");
  expect_error([&] { io::TokenShard::open(with(patch(12, 7, 4))); }, "token dtype code 7");
  expect_error([&] { io::TokenShard::open(with(patch(16, uint64_t{1} << 61, 8))); }, "truncated or corrupt");
  expect_error([&] { io::TokenShard::open(with(patch(24, ~uint64_t{0}, 8))); }, "truncated or corrupt");
  expect_error([&] { io::TokenShard::open(with(patch(32, 1, 8))); }, "first document offset is 1");
  expect_error([&] { io::TokenShard::open(with(patch(40, 9, 8))); }, "document 0 ends at offset 9");
  expect_error([&] { io::TokenShard::open(with(patch(48, 4, 8))); }, "the documents end at token 4");
  expect_error([&] { io::TokenShard::open(with(patch(56 + 12, 300, 4)), 100); }, "token 3 (document 1) is id 300");
  expect_error([&] { io::TokenShard::open(dir / "missing.tok"); }, "cannot open token shard");
  // Unchanged, it opens.
  EXPECT_EQ(io::TokenShard::open(with(bytes), 6).num_tokens(), 5u);
}

TEST(TokenShards, CorpusWriterCutsShardsAndReadsBackInOrder) {
  Corpus c;
  c.train_lens = {10, 25, 3, 50, 7, 1};
  c.eval_lens = {4, 5};
  write_corpus(c, /*shard_tokens=*/30);
  const auto meta = io::TokenCorpusMeta::read(c.dir.path());
  EXPECT_EQ(meta.train.documents, 6u);
  EXPECT_EQ(meta.train.tokens, 96u);
  // 10+25 > 30 cuts; 25+3; 50 alone; 7+1.
  ASSERT_EQ(meta.train.shards.size(), 4u);
  EXPECT_EQ(meta.train.shards[2].file, "train-00002.tok");
  EXPECT_EQ(meta.train.shards[2].tokens, 50u);
  EXPECT_EQ(meta.eval.documents, 2u);
  EXPECT_TRUE(fs::exists(c.dir / "eval-00000.tok"));
  const auto split = io::TokenSplit::open(c.dir.path(), "train");
  ASSERT_EQ(split.num_documents(), 6u);
  for (uint64_t d = 0; d < 6; ++d) {
    const auto doc = split.document(d);
    const auto want = make_doc(static_cast<int64_t>(d), c.train_lens[d]);
    EXPECT_EQ(std::vector<int32_t>(doc.begin(), doc.end()), want) << "document " << d;
  }
  // Rewriting the directory with fewer shards leaves none of the old ones.
  io::TokenCorpusWriter w(c.dir.path(), 30, 1000);
  w.add("train", make_doc(0, 3));
  w.finish({});
  EXPECT_FALSE(fs::exists(c.dir / "train-00001.tok"));
  EXPECT_FALSE(fs::exists(c.dir / "eval-00000.tok"));
  EXPECT_EQ(io::TokenSplit::open(c.dir.path(), "train").num_documents(), 1u);
}

TEST(TokenShards, IncompleteOrInconsistentDirectoriesAreRejected) {
  Corpus c;
  c.train_lens = {5, 6};
  write_corpus(c);
  auto cfg = tokens_config(c, 1, 4);
  const std::string meta_text = read_bytes(c.dir / "meta.json");

  fs::remove(c.dir / "meta.json");
  expect_error([&] { io::TokenSplit::open(c.dir.path(), "train"); }, "has no meta.json");
  expect_error([&] { train::open_dataset(cfg); }, "has no meta.json");

  json meta = json::parse(meta_text);
  meta["splits"]["train"]["documents"] = 3;
  write_bytes(c.dir / "meta.json", meta.dump());
  expect_error([&] { train::open_dataset(cfg); }, "claims 3 documents and 11 tokens but its shards add up to 2");

  meta = json::parse(meta_text);
  meta["splits"]["train"]["shards"][0]["file"] = "../elsewhere.tok";
  write_bytes(c.dir / "meta.json", meta.dump());
  expect_error([&] { train::open_dataset(cfg); }, "expected 'train-00000.tok'");

  meta = json::parse(meta_text);
  meta["splits"]["train"]["documents"] = 3;
  meta["splits"]["train"]["shards"][0]["documents"] = 3;
  write_bytes(c.dir / "meta.json", meta.dump());
  expect_error([&] { train::open_dataset(cfg); }, "holds 2 documents and 11 tokens, but meta.json says 3 and 11");

  write_bytes(c.dir / "meta.json", "{not json");
  expect_error([&] { train::open_dataset(cfg); }, "is not valid JSON");

  write_bytes(c.dir / "meta.json", meta_text);
  fs::remove(c.dir / "train-00000.tok");
  expect_error([&] { train::open_dataset(cfg); }, "shard 'train-00000.tok' listed in meta.json is missing");
}

// ---------------------------------------------------------------------------
// Packing

// Rows of seq + 1 tokens rebuilt from a batch: inputs, then the last target.
std::vector<std::vector<int32_t>> rows_of(const model::TrainBatch& b) {
  std::vector<std::vector<int32_t>> rows;
  for (int64_t r = 0; r < b.batch; ++r) {
    std::vector<int32_t> row(b.inputs.begin() + r * b.seq, b.inputs.begin() + (r + 1) * b.seq);
    row.push_back(b.targets[(r + 1) * b.seq - 1]);
    rows.push_back(row);
  }
  return rows;
}

// The invariants of one packed batch of documents made by make_doc.
void check_packed_batch(const model::TrainBatch& b, int64_t vocab) {
  model_check(b, vocab);
  const int64_t T = b.seq;
  for (int64_t r = 0; r < b.batch; ++r) {
    int32_t seg = 0;
    int64_t piece_start = 0;  // the document position of the current piece's first token
    for (int64_t j = 0; j < T; ++j) {
      const size_t o = static_cast<size_t>(r * T + j);
      const int32_t in = b.inputs[o], tgt = b.targets[o];
      if (j + 1 < T) {
        ASSERT_EQ(tgt, b.inputs[o + 1]) << "targets are the inputs shifted by one";
      }
      if (in == 0) {  // padding
        EXPECT_EQ(b.segment_ids[o], 0);
        EXPECT_EQ(b.target_segment_ids[o], 0) << "padding is never counted";
        continue;
      }
      // A new piece: a row's first token, or not the successor of the
      // previous token (another document, or the same one again at an epoch
      // boundary).
      const bool new_piece = j == 0 || b.inputs[o - 1] == 0 || doc_of(b.inputs[o - 1]) != doc_of(in) ||
                             pos_of(in) != pos_of(b.inputs[o - 1]) + 1;
      if (new_piece) {
        ++seg;
        piece_start = pos_of(in);
        if (j > 0) {
          EXPECT_EQ(pos_of(in), 0) << "only a row's first piece may continue a document";
        }
      }
      EXPECT_EQ(b.segment_ids[o], seg) << "row " << r << " column " << j;
      EXPECT_EQ(b.positions[o], pos_of(in) - piece_start) << "positions restart per document piece";
      const bool same_doc = tgt != 0 && doc_of(tgt) == doc_of(in) && pos_of(tgt) == pos_of(in) + 1;
      EXPECT_EQ(b.target_segment_ids[o], same_doc ? seg : 0) << "row " << r << " column " << j;
    }
  }
}

// The document order of the stream of packed rows: runs of one document's
// tokens 0..len-1 in order, each run complete.
std::vector<int64_t> document_runs(const std::vector<std::vector<int32_t>>& rows, const std::vector<int64_t>& lens,
                                   int64_t first_doc_id = 0) {
  std::vector<int64_t> order;
  int64_t want_next = 0, cur = -1;
  for (const auto& row : rows)
    for (int32_t id : row) {
      if (id == 0) continue;
      const int64_t d = doc_of(id), k = pos_of(id);
      if (cur >= 0) {
        EXPECT_TRUE((d == cur && k == want_next) || (k == 0 && want_next == lens[cur - first_doc_id]))
            << "document " << cur << " broken off at token " << want_next << " by (" << d << ", " << k << ")";
      }
      if (k == 0) order.push_back(d);
      cur = d;
      want_next = k + 1;
    }
  return order;
}

TEST(TokensDataset, PackingCoversEveryTokenOncePerEpochInOrder) {
  Corpus c;
  for (int64_t d = 0; d < 20; ++d) c.train_lens.push_back(1 + (d * 7) % 23);  // 1..23 tokens
  write_corpus(c, /*shard_tokens=*/50);
  int64_t total = 0;
  for (int64_t l : c.train_lens) total += l;  // 246
  const int64_t batch = 3, seq = 7;           // rows of 8 tokens
  auto ds = train::open_dataset(tokens_config(c, batch, seq, /*seed=*/5));
  std::vector<std::vector<int32_t>> rows;
  // Three epochs and a bit.
  while (static_cast<int64_t>(rows.size()) * (seq + 1) < 3 * total + 30) {
    const auto b = ds->next();
    check_packed_batch(b, c.vocab);
    for (auto& r : rows_of(b)) rows.push_back(r);
  }
  const auto order = document_runs(rows, c.train_lens);
  ASSERT_GE(order.size(), 60u);
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    std::vector<int64_t> ep(order.begin() + e * 20, order.begin() + (e + 1) * 20);
    std::set<int64_t> docs(ep.begin(), ep.end());
    EXPECT_EQ(docs.size(), 20u) << "epoch " << e << " holds every document exactly once";
    epochs.push_back(ep);
  }
  EXPECT_NE(epochs[0], epochs[1]) << "the order is reshuffled each epoch";
  EXPECT_NE(epochs[1], epochs[2]);
  std::vector<int64_t> identity(20);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(epochs[0], identity) << "training order is shuffled";
  // Packing leaves no padding: every row is full.
  for (const auto& r : rows)
    for (int32_t id : r) EXPECT_NE(id, 0);
}

TEST(TokensDataset, ShuffleIsSeeded) {
  Corpus c;
  for (int64_t d = 0; d < 12; ++d) c.train_lens.push_back(3 + d % 5);
  write_corpus(c);
  auto run = [&](uint64_t seed) {
    auto ds = train::open_dataset(tokens_config(c, 2, 9, seed));
    std::vector<model::TrainBatch> out;
    for (int i = 0; i < 6; ++i) out.push_back(ds->next());
    return out;
  };
  const auto a = run(1), b = run(1), other = run(2);
  bool all_same = true, any_diff = false;
  for (size_t i = 0; i < a.size(); ++i) {
    all_same = all_same && same(a[i], b[i]);
    any_diff = any_diff || !same(a[i], other[i]);
  }
  EXPECT_TRUE(all_same) << "the same seed gives the same batches";
  EXPECT_TRUE(any_diff) << "another seed gives another order";
}

TEST(TokensDataset, LongDocumentsAreSplitAcrossRows) {
  Corpus c;
  c.train_lens = {30};
  write_corpus(c);
  auto ds = train::open_dataset(tokens_config(c, 1, 9));  // rows of 10
  for (int i = 0; i < 3; ++i) {
    const auto b = ds->next();
    check_packed_batch(b, c.vocab);
    for (int64_t j = 0; j < 9; ++j) {
      EXPECT_EQ(b.inputs[j], id_of(0, i * 10 + j));
      EXPECT_EQ(b.positions[j], j) << "positions restart at 0 in each row's piece";
      EXPECT_EQ(b.segment_ids[j], 1);
      EXPECT_EQ(b.target_segment_ids[j], 1);
    }
  }
  // The next epoch starts the document again in a fresh row.
  EXPECT_EQ(ds->next().inputs[0], id_of(0, 0));
  EXPECT_EQ(ds->state()["epoch"], 1);
}

TEST(TokensDataset, WithoutPackingRowsArePaddedAndPaddingIsNotCounted) {
  Corpus c;
  c.train_lens = {3, 12, 5};
  write_corpus(c);
  auto cfg = tokens_config(c, 4, 7);  // rows of 8
  cfg.packing = false;
  auto ds = train::open_dataset(cfg);
  int64_t padded = 0;
  for (int i = 0; i < 5; ++i) {
    const auto b = ds->next();
    check_packed_batch(b, c.vocab);
    for (const auto& row : rows_of(b)) {
      std::set<int64_t> docs;
      for (int32_t id : row)
        if (id != 0) docs.insert(doc_of(id));
      EXPECT_EQ(docs.size(), 1u) << "one document per row";
    }
    for (size_t o = 0; o < b.inputs.size(); ++o)
      if (b.targets[o] == 0) {
        ++padded;
        EXPECT_EQ(b.target_segment_ids[o], 0);
      }
  }
  EXPECT_GT(padded, 0);
}

TEST(TokensDataset, StateRestoreContinuesBitExactly) {
  Corpus c;
  for (int64_t d = 0; d < 9; ++d) c.train_lens.push_back(2 + (d * 5) % 11);
  write_corpus(c);
  const auto cfg = tokens_config(c, 2, 6, /*seed=*/3);
  for (int before : {0, 1, 4, 13}) {  // 13 batches crosses several epochs
    auto a = train::open_dataset(cfg);
    for (int i = 0; i < before; ++i) a->next();
    const json state = a->state();
    ASSERT_TRUE(state.contains("epoch") && state.contains("index") && state.contains("offset")) << state.dump();
    std::vector<model::TrainBatch> want;
    for (int i = 0; i < 7; ++i) want.push_back(a->next());
    auto b = train::open_dataset(cfg);
    b->next();                              // anywhere else first
    b->restore(json::parse(state.dump()));  // through text, as a checkpoint stores it
    for (int i = 0; i < 7; ++i) EXPECT_TRUE(same(b->next(), want[i])) << "after " << before << ", batch " << i;
  }
  auto a = train::open_dataset(cfg);
  expect_error(
      [&] {
        a->restore(json{{"epoch", 0}, {"index", 9}, {"offset", 0}});
      },
      "document index 9 is outside the 9 documents");
  expect_error([&] { a->restore(json{{"epoch", 0}, {"index", 0}, {"offset", 99}}); }, "offset 99 is outside");
  expect_error(
      [&] {
        a->restore(json{{"epoch", 0}, {"index", 0}, {"offset", 0}, {"documents", 4}});
      },
      "saved for a split of 4 documents");
  expect_error([&] { a->restore(json{{"step", 3}}); }, "lacks \"epoch\"");
}

TEST(TokensDataset, EvalSplitIsInOrderWrapsAndRewinds) {
  Corpus c;
  c.train_lens = {4, 4};
  c.eval_lens = {5, 9, 3};  // documents 2, 3, 4: 17 tokens
  write_corpus(c);
  auto ds = train::open_dataset(tokens_config(c, 1, 5), Split::Eval);  // rows of 6
  std::vector<std::vector<int32_t>> rows;
  std::vector<model::TrainBatch> first;
  for (int i = 0; i < 6; ++i) {
    const auto b = ds->next();
    check_packed_batch(b, c.vocab);
    if (i < 2) first.push_back(b);
    for (auto& r : rows_of(b)) rows.push_back(r);
  }
  const auto order = document_runs(rows, c.eval_lens, 2);
  ASSERT_GE(order.size(), 6u);
  EXPECT_EQ(std::vector<int64_t>(order.begin(), order.begin() + 6), (std::vector<int64_t>{2, 3, 4, 2, 3, 4}))
      << "eval runs in stored order and wraps around";
  ds->rewind();
  EXPECT_TRUE(same(ds->next(), first[0]));
  EXPECT_TRUE(same(ds->next(), first[1]));

  Corpus no_eval;
  no_eval.train_lens = {4};
  write_corpus(no_eval);
  expect_error([&] { train::open_dataset(tokens_config(no_eval, 1, 4), Split::Eval); }, "has no eval tokens");
}

TEST(TokensDataset, EmptyAndOutOfVocabularyCorporaAreRejected) {
  Corpus c;
  c.train_lens = {0, 0};
  write_corpus(c);
  expect_error([&] { train::open_dataset(tokens_config(c, 1, 4)); }, "has no train tokens");

  Corpus big;
  big.train_lens = {5, 6};
  write_corpus(big);
  auto cfg = tokens_config(big, 1, 4);
  cfg.vocab_size = 70;  // document 1 holds ids 65..70
  expect_error([&] { train::open_dataset(cfg); }, "is id 70, not below the vocabulary size 70");
}

// ---------------------------------------------------------------------------
// json

DataConfig json_config(const std::string& path, int64_t batch, int64_t seq, int64_t vocab = 50) {
  DataConfig cfg;
  cfg.dataset_type = "json";
  cfg.dataset_path = path;
  cfg.batch = batch;
  cfg.seq = seq;
  cfg.vocab_size = vocab;
  return cfg;
}

TEST(JsonDataset, ReplaysExactlyAndEnds) {
  TempDir dir;
  const json steps = {{{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}},
                      {{11, 12, 13, 14, 15}, {16, 17, 18, 19, 20}},
                      {{21, 22, 23, 24, 25}, {26, 27, 28, 29, 49}}};
  write_bytes(dir / "steps.json", steps.dump());
  auto ds = train::open_dataset(json_config(dir / "steps.json", 2, 4));
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(ds->state()["step"], s);
    const auto b = ds->next();
    model_check(b, 50);
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < 4; ++j) {
        const size_t o = static_cast<size_t>(r * 4 + j);
        EXPECT_EQ(b.inputs[o], steps[s][r][j].get<int32_t>());
        EXPECT_EQ(b.targets[o], steps[s][r][j + 1].get<int32_t>());
        EXPECT_EQ(b.positions[o], j);
        EXPECT_EQ(b.segment_ids[o], 1);
        EXPECT_EQ(b.target_segment_ids[o], 1);
      }
  }
  expect_error([&] { ds->next(); }, "exhausted after 3 steps");
  ds->restore(json{{"step", 1}});
  EXPECT_EQ(ds->next().inputs[0], 11);
  ds->rewind();
  EXPECT_EQ(ds->next().inputs[0], 1);
  expect_error([&] { ds->restore(json{{"step", 4}}); }, "step 4 is past the end");
}

TEST(JsonDataset, RejectsWrongShapesAndIdsNamingTheSpot) {
  TempDir dir;
  auto open = [&](const std::string& text, int64_t vocab = 50) {
    write_bytes(dir / "d.json", text);
    train::open_dataset(json_config(dir / "d.json", 2, 3, vocab));
  };
  expect_error([&] { open("[[[1,2,3,4],[1,2,3,4]], [[1,2,3,4]]]"); },
               "step 1 must be an array of batch = 2 rows, got 1 rows");
  expect_error([&] { open("[[[1,2,3,4],[1,2,3]]]"); }, "step 0, row 1 must hold seq + 1 = 4 token ids, got 3 ids");
  expect_error([&] { open("[[[1,2,3,4],[1,2,3,50]]]"); }, "step 0, row 1, column 3: 50 is not a token id below");
  expect_error([&] { open("[[[1,2,-1,4],[1,2,3,4]]]"); }, "step 0, row 0, column 2: -1 is not a token id");
  expect_error([&] { open("[[[1,2,3.5,4],[1,2,3,4]]]"); }, "column 2: 3.5 is not a token id");
  expect_error([&] { open("[[[1,2,3,4],[1,2,3,4]]"); }, "is not valid JSON");
  expect_error([&] { open("[]"); }, "is empty");
  expect_error([&] { open("{\"a\": 1}"); }, "must be a JSON array of steps");
  expect_error([&] { train::open_dataset(json_config(dir / "none.json", 1, 3)); }, "does not exist");
  expect_error([&] { train::open_dataset(json_config(dir.path(), 1, 3)); }, "is a directory");
  write_bytes(dir / "ok.json", "[[[1,2,3,4],[1,2,3,4]]]");
  expect_error([&] { train::open_dataset(json_config(dir / "ok.json", 2, 3), Split::Eval); },
               "dataset_type=json has no eval split");
}

// ---------------------------------------------------------------------------
// synthetic

DataConfig synthetic_config(const std::string& task, int64_t batch, int64_t seq, uint64_t seed = 0) {
  DataConfig cfg;
  cfg.synthetic_task = task;
  cfg.batch = batch;
  cfg.seq = seq;
  cfg.vocab_size = 97;
  cfg.seed = seed;
  return cfg;
}

TEST(SyntheticDataset, RandomIsOneFixedBatch) {
  auto ds = train::open_dataset(synthetic_config("random", 3, 16, 7));
  const auto first = ds->next();
  model_check(first, 97);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(same(ds->next(), first)) << "step " << i + 1;
  std::set<int32_t> distinct(first.inputs.begin(), first.inputs.end());
  EXPECT_GT(distinct.size(), 10u) << "random tokens";
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t j = 0; j < 16; ++j) {
      const size_t o = static_cast<size_t>(r * 16 + j);
      EXPECT_EQ(first.positions[o], j);
      EXPECT_EQ(first.segment_ids[o], 1);
      EXPECT_EQ(first.target_segment_ids[o], 1);
      if (j < 15) {
        EXPECT_EQ(first.targets[o], first.inputs[o + 1]);
      }
    }
  EXPECT_FALSE(same(train::open_dataset(synthetic_config("random", 3, 16, 8))->next(), first)) << "seeded";
  EXPECT_TRUE(same(train::open_dataset(synthetic_config("random", 3, 16, 7))->next(), first));
  expect_error([&] { train::open_dataset(synthetic_config("random", 1, 4), Split::Eval); },
               "dataset_type=synthetic has no eval split");
}

TEST(SyntheticDataset, CopySecondHalfEqualsFirstHalf) {
  for (int64_t seq : {15, 16}) {  // rows of 16 tokens, and 17 (odd: one padding token)
    auto ds = train::open_dataset(synthetic_config("copy", 4, seq, 1));
    std::vector<model::TrainBatch> batches;
    for (int i = 0; i < 3; ++i) batches.push_back(ds->next());
    const json state = ds->state();
    EXPECT_EQ(state["step"], 3);
    for (const auto& b : batches) {
      model_check(b, 97);
      for (const auto& row : rows_of(b)) {
        const size_t n = (seq + 1) / 2;
        for (size_t k = 0; k < n; ++k) EXPECT_EQ(row[n + k], row[k]) << "seq " << seq;
        if ((seq + 1) % 2 == 1) {
          EXPECT_EQ(row.back(), 0);
        }
      }
      for (int64_t r = 0; r < b.batch; ++r)
        for (int64_t j = 0; j < seq; ++j) {
          const size_t o = static_cast<size_t>(r * seq + j);
          EXPECT_EQ(b.positions[o], j);
          EXPECT_EQ(b.segment_ids[o], 1);
          // With an odd row the last target is the padding token.
          EXPECT_EQ(b.target_segment_ids[o], seq % 2 == 0 && j == seq - 1 ? 0 : 1);
        }
    }
    EXPECT_FALSE(same(batches[0], batches[1])) << "fresh rows every step";
    // Resuming from a state gives the same steps.
    auto again = train::open_dataset(synthetic_config("copy", 4, seq, 1));
    again->restore(json{{"step", 1}});
    EXPECT_TRUE(same(again->next(), batches[1]));
    again->rewind();
    EXPECT_TRUE(same(again->next(), batches[0]));
  }
}

// ---------------------------------------------------------------------------
// configuration errors

TEST(OpenDataset, RejectsBadConfiguration) {
  auto cfg = synthetic_config("random", 1, 4);
  auto with = [&](const std::function<void(DataConfig&)>& edit) {
    DataConfig c = cfg;
    edit(c);
    return [c] { train::open_dataset(c); };
  };
  expect_error(with([](DataConfig& c) { c.dataset_type = "parquet"; }), "unknown dataset_type 'parquet'");
  expect_error(with([](DataConfig& c) { c.synthetic_task = "sort"; }), "unknown synthetic_task 'sort'");
  expect_error(with([](DataConfig& c) { c.seq = 0; }), "seq (tokens per row) must be in [1,");
  expect_error(with([](DataConfig& c) { c.batch = 0; }), "batch (rows per step) must be at least 1");
  expect_error(with([](DataConfig& c) { c.vocab_size = 0; }), "vocab_size must be in [1, 2^31]");
  expect_error(with([](DataConfig& c) { c.batch = int64_t{1} << 40; }), "tokens per step");
  expect_error(with([](DataConfig& c) { c.dataset_type = "tokens"; }), "dataset_type=tokens needs dataset_path");
  expect_error(with([](DataConfig& c) {
                 c.dataset_type = "tokens";
                 c.dataset_path = "/nonexistent/corpus";
               }),
               "dataset_path '/nonexistent/corpus' does not exist");
  TempDir dir;
  expect_error(with([&](DataConfig& c) {
                 c.dataset_type = "tokens";
                 c.dataset_path = dir.path();
               }),
               "has no meta.json");
}

}  // namespace data_test
}  // namespace
}  // namespace ds
