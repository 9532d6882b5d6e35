// The GGUF container (io/gguf.h): what Writer writes, Reader reads back
// (values of every kind, tensors at aligned offsets with their bytes), and
// Reader refuses every malformed file with one ds::Error: each truncation of
// a valid file, counts and lengths past the file, unknown value types,
// duplicate keys and tensors, misaligned, overlapping or outside tensors.
#include "io/gguf.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace {
namespace gguf_test {

namespace gguf = ds::io::gguf;
namespace fs = std::filesystem;

class GgufTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_gguf_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file with every kind of value and three tensors.
  std::string write_sample() {
    gguf::Writer w;
    w.set("general.architecture", gguf::Value::str("deepseek2"));
    w.set("deepseek2.block_count", gguf::Value::u32(3));
    w.set("deepseek2.rope.freq_base", gguf::Value::f32(10000.0f));
    w.set("deepseek2.expert_weights_norm", gguf::Value::boolean(true));
    w.set("tokenizer.ggml.tokens", gguf::Value::strings({"a", "b", "<｜end▁of▁sentence｜>"}));
    w.set("tokenizer.ggml.token_type", gguf::Value::i32s({1, 1, 3}));
    w.set("x.scores", gguf::Value::f32s({0.5f, -1.0f}));
    w.set("deepseek2.block_count", gguf::Value::u32(4));  // a later set replaces
    f32_.resize(6);
    for (size_t i = 0; i < f32_.size(); ++i) f32_[i] = 0.25f * static_cast<float>(i) - 1;
    w.add_tensor("a.weight", gguf::TensorType::F32, {3, 2}, [&](auto put) { put(f32_.data(), 24); });
    bf16_ = {0x3f80, 0x4000, 0xbf80};
    w.add_tensor("b.weight", gguf::TensorType::BF16, {3}, [&](auto put) { put(bf16_.data(), 6); });
    q8_.assign(68, 7);
    w.add_tensor("c.weight", gguf::TensorType::Q8_0, {32, 2}, [&](auto put) { put(q8_.data(), q8_.size()); });
    const std::string path = dir_ + "/m.gguf";
    const uint64_t written = w.write(path);
    EXPECT_EQ(written, fs::file_size(path));
    return path;
  }
  static std::vector<uint8_t> bytes_of(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  static std::string refusal(const std::vector<uint8_t>& b) {
    try {
      gguf::Reader::parse(b, "x.gguf");
      return "ok";
    } catch (const ds::Error& e) {
      return e.what();
    }
  }

  std::string dir_;
  std::vector<float> f32_;
  std::vector<uint16_t> bf16_;
  std::vector<uint8_t> q8_;
};

TEST_F(GgufTest, WhatIsWrittenIsRead) {
  const auto r = gguf::Reader::open(write_sample());
  EXPECT_EQ(r.version(), 3u);
  ASSERT_EQ(r.values().size(), 7u);
  EXPECT_EQ(std::get<std::string>(r.find("general.architecture")->scalar), "deepseek2");
  EXPECT_EQ(std::get<uint64_t>(r.find("deepseek2.block_count")->scalar), 4u);
  EXPECT_EQ(std::get<double>(r.find("deepseek2.rope.freq_base")->scalar), 10000.0);
  EXPECT_TRUE(std::get<bool>(r.find("deepseek2.expert_weights_norm")->scalar));
  const auto* tokens = r.find("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens->array.size(), 3u);
  EXPECT_EQ(std::get<std::string>(tokens->array[2]), "<｜end▁of▁sentence｜>");
  EXPECT_EQ(std::get<int64_t>(r.find("tokenizer.ggml.token_type")->array[2]), 3);
  EXPECT_EQ(std::get<double>(r.find("x.scores")->array[1]), -1.0);
  ASSERT_EQ(r.tensors().size(), 3u);
  const auto* a = r.tensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->ne, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a->numel(), 6);
  ASSERT_EQ(r.data(*a).size(), 24u);
  EXPECT_EQ(std::memcmp(r.data(*a).data(), f32_.data(), 24), 0);
  const auto* b = r.tensor("b.weight");
  EXPECT_EQ(b->offset % 32, 0u);
  EXPECT_EQ(std::memcmp(r.data(*b).data(), bf16_.data(), 6), 0);
  const auto* c = r.tensor("c.weight");
  EXPECT_EQ(c->type, gguf::TensorType::Q8_0);
  EXPECT_EQ(r.data(*c).size(), 68u);
  EXPECT_EQ(r.tensor("none"), nullptr);
}

TEST_F(GgufTest, EveryTruncationIsRefused) {
  const auto b = bytes_of(write_sample());
  // The last tensor's 68 bytes are padded to 96; the padding is not needed.
  const size_t needed = b.size() - (96 - 68);
  for (size_t n = 0; n < b.size(); ++n) {
    const std::string got = refusal(std::vector<uint8_t>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n)));
    if (n < needed)
      EXPECT_NE(got, "ok") << "cut at " << n;
    else
      EXPECT_EQ(got, "ok") << "cut at " << n;
  }
}

TEST_F(GgufTest, MalformedHeadersAreRefused) {
  const auto good = bytes_of(write_sample());
  auto with = [&](size_t at, const void* v, size_t n) {
    auto b = good;
    std::memcpy(b.data() + at, v, n);
    return refusal(b);
  };
  EXPECT_NE(refusal({'G', 'G', 'U'}), "ok");
  EXPECT_NE(with(0, "GGML", 4).find("not a GGUF file"), std::string::npos);
  const uint32_t v9 = 9;
  EXPECT_NE(with(4, &v9, 4).find("version 9"), std::string::npos);
  const uint64_t huge = uint64_t{1} << 60;
  EXPECT_NE(with(8, &huge, 8).find("cannot fit"), std::string::npos);   // tensor count
  EXPECT_NE(with(16, &huge, 8).find("cannot fit"), std::string::npos);  // key count
  EXPECT_NE(with(24, &huge, 8), "ok");                                  // the first key's length
  // The first key's value type (after its 20-byte name).
  const uint32_t bad_type = 13;
  EXPECT_NE(with(24 + 8 + 20, &bad_type, 4).find("value type 13"), std::string::npos);
}

TEST_F(GgufTest, TensorsOutsideOrOverlappingAreRefused) {
  auto tensor_file = [&](std::vector<std::pair<uint64_t, uint64_t>> at, uint32_t align) {
    // Hand-made: no keys but general.alignment, tensors of 32 F32 at the offsets given.
    std::string s;
    auto pod = [&](auto v) { s.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    auto str = [&](const std::string& x) {
      pod(uint64_t{x.size()});
      s += x;
    };
    pod(uint32_t{0x46554747});
    pod(uint32_t{3});
    pod(uint64_t{at.size()});
    pod(uint64_t{1});
    str("general.alignment");
    pod(uint32_t{4});
    pod(align);
    for (size_t i = 0; i < at.size(); ++i) {
      str(std::string(1, static_cast<char>('a' + i)));
      pod(uint32_t{1});
      pod(uint64_t{at[i].second});
      pod(uint32_t{0});
      pod(at[i].first);
    }
    s.resize((s.size() + 31) / 32 * 32, '\0');
    s.resize(s.size() + 256, '\0');
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  EXPECT_EQ(refusal(tensor_file({{0, 32}, {128, 32}}, 32)), "ok");
  EXPECT_NE(refusal(tensor_file({{0, 32}, {64, 32}}, 32)).find("overlap"), std::string::npos);
  EXPECT_NE(refusal(tensor_file({{256, 32}}, 32)).find("runs past"), std::string::npos);
  EXPECT_NE(refusal(tensor_file({{16, 4}}, 32)).find("not a multiple"), std::string::npos);
  EXPECT_NE(refusal(tensor_file({{0, 4}}, 3)).find("power of two"), std::string::npos);
  EXPECT_NE(refusal(tensor_file({{0, 4}, {0, 4}}, 32)), "ok");
}

TEST_F(GgufTest, WriterRefusesWhatItCannotWrite) {
  gguf::Writer w;
  EXPECT_THROW(w.add_tensor("q", gguf::TensorType::Q8_0, {33}, [](auto) {}), ds::Error);
  EXPECT_THROW(w.add_tensor("q", gguf::TensorType::Q2_K, {256}, [](auto) {}), ds::Error);
  w.add_tensor("short", gguf::TensorType::F32, {4}, [](auto put) { put("abcd", 4); });
  EXPECT_THROW(w.write(dir_ + "/short.gguf"), ds::Error);
  EXPECT_FALSE(fs::exists(dir_ + "/short.gguf"));  // nothing left half-written
}

}  // namespace gguf_test
}  // namespace
