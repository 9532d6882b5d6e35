// safetensors reading and writing: round trips, zero-copy borrowing, sharded
// folders, atomic replacement, and one clear ds::Error for each kind of
// malformed file (plus a mutation smoke test of the header parser).
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"

namespace fs = std::filesystem;
using ds::DType;
using ds::Tensor;
using ds::io::SafetensorsFile;
using ds::io::SafetensorsSet;

namespace {
namespace safetensors_test {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_safetensors_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Writes a file with the given header text and data bytes; `len` overrides
  // the header length field when non-negative.
  std::string write_raw(const std::string& name, const std::string& header, const std::string& data,
                        int64_t len = -1) const {
    std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    uint64_t n = len < 0 ? header.size() : static_cast<uint64_t>(len);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << header << data;
    return p;
  }
  std::string dir_;
};

// Expects opening `p` to throw ds::Error mentioning `needle`.
void expect_open_error(const std::string& p, const std::string& needle) {
  try {
    SafetensorsFile::open(p);
    ADD_FAILURE() << "no error opening " << p << " (expected '" << needle << "')";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, RoundTripKeepsDtypesShapesValuesAndMetadata) {
  Tensor a = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = a.transpose(0, 1);  // non-contiguous: written in logical order
  Tensor c = Tensor::from_vector({0.5f, -1.25f, 3.0f, 1e-3f}, {4}).to(DType::BF16);
  Tensor d = Tensor::zeros({}, DType::I32);
  d.data<int32_t>()[0] = -7;
  Tensor e = Tensor::zeros({0, 5}, DType::F32);
  ds::io::save_safetensors(path("m.safetensors"), {{"a", a}, {"b", b}, {"c", c}, {"d", d}, {"e", e}},
                           {{"format", "pt"}});
  auto f = SafetensorsFile::open(path("m.safetensors"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.tensor("a").to_vector(), a.to_vector());
  EXPECT_EQ(f.tensor("b").shape(), (ds::Shape{3, 2}));
  EXPECT_EQ(f.tensor("b").to_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(f.tensor("c").dtype(), DType::BF16);
  EXPECT_EQ(f.tensor("c").to_vector(), c.to_vector());
  EXPECT_EQ(f.tensor("d").data<int32_t>()[0], -7);
  EXPECT_EQ(f.tensor("e").numel(), 0);
  EXPECT_FALSE(f.contains("z"));
  EXPECT_THROW(f.tensor("z"), ds::Error);
}

TEST_F(SafetensorsTest, TensorsBorrowTheMappingAndOutliveTheFileObject) {
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  ds::io::save_safetensors(path("m.safetensors"), {{"w", Tensor::from_vector(v, {10, 100})}});
  Tensor t;
  {
    auto f = SafetensorsFile::open(path("m.safetensors"));
    t = f.tensor("w");
    Tensor again = f.tensor("w");
    EXPECT_EQ(t.raw(), again.raw());  // the same mapped bytes, no copy
    // The data block starts 8-byte aligned because the writer pads the header.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 8, 0u);
  }
  EXPECT_EQ(t.to_vector(), v);  // still mapped after the file object is gone
}

TEST_F(SafetensorsTest, ShardedFolderThroughTheIndex) {
  ds::io::save_safetensors(path("model-00001-of-00002.safetensors"), {{"x", Tensor::from_vector({1, 2}, {2})}});
  ds::io::save_safetensors(path("model-00002-of-00002.safetensors"), {{"y", Tensor::from_vector({3}, {1})}});
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"metadata": {"total_size": 12}, "weight_map": {"x": "model-00001-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors"}})";
  auto s = SafetensorsSet::open_dir(dir_);
  EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(s.tensor("x").to_vector(), (std::vector<float>{1, 2}));
  EXPECT_EQ(s.tensor("y").to_vector(), (std::vector<float>{3}));
  EXPECT_THROW(s.tensor("z"), ds::Error);

  // An index that places a tensor in the wrong shard is an error.
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"x": "model-00002-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}})";
  EXPECT_THROW(SafetensorsSet::open_dir(dir_), ds::Error);
  // A shard name that leaves the folder is refused.
  std::ofstream(path("model.safetensors.index.json")) << R"({"weight_map": {"x": "../x.safetensors"}})";
  EXPECT_THROW(SafetensorsSet::open_dir(dir_), ds::Error);
  std::ofstream(path("model.safetensors.index.json")) << "{not json";
  EXPECT_THROW(SafetensorsSet::open_dir(dir_), ds::Error);
}

TEST_F(SafetensorsTest, SingleFileFolderAndMissingFolders) {
  EXPECT_THROW(SafetensorsSet::open_dir(path("nope")), ds::Error);
  EXPECT_THROW(SafetensorsSet::open_dir(dir_), ds::Error);  // neither index nor model.safetensors
  ds::io::save_safetensors(path("model.safetensors"), {{"x", Tensor::from_vector({1}, {1})}});
  EXPECT_EQ(SafetensorsSet::open_dir(dir_).tensor("x").to_vector(), (std::vector<float>{1}));
}

TEST_F(SafetensorsTest, DuplicateTensorAcrossFilesIsAnError) {
  ds::io::save_safetensors(path("a.safetensors"), {{"x", Tensor::from_vector({1}, {1})}});
  ds::io::save_safetensors(path("b.safetensors"), {{"x", Tensor::from_vector({2}, {1})}});
  EXPECT_THROW(SafetensorsSet::open_files({path("a.safetensors"), path("b.safetensors")}), ds::Error);
}

TEST_F(SafetensorsTest, SaveReplacesAtomicallyAndLeavesNoTemporaryFiles) {
  ds::io::save_safetensors(path("m.safetensors"), {{"x", Tensor::from_vector({1}, {1})}});
  ds::io::save_safetensors(path("m.safetensors"), {{"x", Tensor::from_vector({2, 3}, {2})}});
  EXPECT_EQ(SafetensorsFile::open(path("m.safetensors")).tensor("x").to_vector(), (std::vector<float>{2, 3}));
  int files = 0;
  for (auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  // A failed save (bad arguments) leaves the existing file as it was.
  Tensor x = Tensor::from_vector({9}, {1});
  EXPECT_THROW(ds::io::save_safetensors(path("m.safetensors"), {{"x", x}, {"x", x}}), ds::Error);
  EXPECT_THROW(ds::io::save_safetensors(path("no/such/dir/m.safetensors"), {{"x", x}}), ds::Error);
  EXPECT_EQ(SafetensorsFile::open(path("m.safetensors")).tensor("x").to_vector(), (std::vector<float>{2, 3}));
}

TEST_F(SafetensorsTest, MalformedFilesGiveOneClearError) {
  const std::string ok = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  const std::string data(8, '\0');
  EXPECT_NO_THROW(SafetensorsFile::open(write_raw("ok", ok, data)));

  expect_open_error(path("missing"), "cannot open");
  expect_open_error(dir_, "not a regular file");
  {
    std::ofstream(path("short")) << "abc";
    expect_open_error(path("short"), "too short");
  }
  expect_open_error(write_raw("len_big", ok, data, static_cast<int64_t>(ok.size() + 100)), "header length");
  expect_open_error(write_raw("len_huge", ok, data, int64_t(1) << 62), "header length");
  expect_open_error(write_raw("not_json", "{\"w\": [", data), "not valid JSON");
  expect_open_error(write_raw("array", "[1, 2]", data), "must be a JSON object");
  expect_open_error(write_raw("no_dtype", R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", data), "dtype");
  expect_open_error(write_raw("bad_dtype", R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", data),
                    "unknown dtype");
  expect_open_error(write_raw("neg_shape", R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data),
                    "non-negative");
  expect_open_error(write_raw("offsets3", R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}})", data),
                    "data_offsets");
  expect_open_error(write_raw("beyond", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", data),
                    "outside the data block");
  expect_open_error(write_raw("reversed", R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", data),
                    "outside the data block");
  expect_open_error(write_raw("mismatch", R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}})", data),
                    "bytes expected");
  expect_open_error(
      write_raw("overlap",
                R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                data),
      "overlap");
  expect_open_error(
      write_raw("overflow",
                R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}})",
                data),
      "overflows");
  expect_open_error(write_raw("meta", R"({"__metadata__": {"k": 1}})", ""), "__metadata__");

  // A valid file cut short: the last tensor's bytes are missing.
  ds::io::save_safetensors(path("full"), {{"w", Tensor::from_vector(std::vector<float>(64, 1.0f), {64})}});
  fs::resize_file(path("full"), fs::file_size(path("full")) - 4);
  expect_open_error(path("full"), "truncated");

  // A dtype the format defines but this engine does not hold opens fine and
  // fails only when that tensor is asked for.
  auto f = SafetensorsFile::open(write_raw("f64", R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
                                           data));
  EXPECT_THROW(f.tensor("w"), ds::Error);
}

// Random byte edits, insertions and truncations of a valid header: the parser
// must either accept the result or throw ds::Error, never crash or hang.
TEST(SafetensorsHeaderMutation, NeverCrashes) {
  const std::string base =
      R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
          "b": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [12, 16]}})";
  std::mt19937 gen(1234);
  const std::string alphabet = "{}[]\":,0123456789-eE.abdfhnprstuFIBU8_ \\";
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s = base;
    const int edits = 1 + static_cast<int>(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = gen() % (s.size() + 1);
      switch (gen() % 4) {
        case 0: if (pos < s.size()) s[pos] = alphabet[gen() % alphabet.size()]; break;
        case 1: s.insert(pos, 1, alphabet[gen() % alphabet.size()]); break;
        case 2: if (pos < s.size()) s.erase(pos, 1); break;
        case 3: s.resize(pos); break;
      }
    }
    try {
      ds::io::SafetensorsFile::parse_header(s.data(), s.size(), 16, nullptr);
      ++accepted;
    } catch (const ds::Error&) {
    }
  }
  // Some mutations (inside metadata strings, whitespace) leave a valid header.
  EXPECT_GT(accepted, 0);
}

}  // namespace safetensors_test
}  // namespace
