// A randomly initialised DeepSeek-V4.1 folder in the released checkpoint's
// own formats (model/v41_init.h).
#include "model/v41_init.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "io/token_classes.h"
#include "io/tokenizer.h"
#include "model/init.h"
#include "model/v4_params.h"

namespace ds::model {

namespace fs = std::filesystem;

namespace {

// The power-of-two scale (an e8m0 byte) that maps a block's amax into range.
uint8_t e8m0_for(float amax, float max) {
  if (!(amax > 0)) return 127;
  const int e = static_cast<int>(std::ceil(std::log2(amax / max)));
  return static_cast<uint8_t>(std::clamp(e + 127, 1, 254));
}

// How a tensor is stored.
enum class Store { BF16, F32, Fp8, Fp4 };

struct Entry {
  std::string name, dtype;
  Shape shape;
  uint64_t bytes = 0;
};

// The checkpoint's dtype of each V4.1 tensor (DeepSeek's release).
Store store_of(const V4ParamInfo& i, const V4Config& c) {
  const std::string& n = i.name;
  if (i.role == V4Role::EngramTable) return Store::Fp8;
  if (i.role == V4Role::Vector)
    return n.ends_with("attn_sink") || n.find(".hc_") != std::string::npos || n.rfind("hc_", 0) == 0 ||
                   n.ends_with("gate.bias") || n.ends_with("gate.bias_vl")
               ? Store::F32
               : Store::BF16;
  if (i.role != V4Role::Projection) return Store::BF16;  // embedding, head, router
  if (i.routed_expert && c.expert_dtype == "fp4") return Store::Fp4;
  if (n.find(".compressor.") != std::string::npos || n.ends_with("indexer.wk.weight") ||
      n.ends_with("indexer.weights_proj.weight"))
    return Store::BF16;
  return Store::Fp8;
}

// A tensor's values: N(0, std) for matrices, the vectors' fixed starts.
float std_of(const V4ParamInfo& i) {
  if (i.role == V4Role::Embedding || i.role == V4Role::EngramTable) return 1.0f;
  if (i.role == V4Role::Vector) return i.name.find("_fn") != std::string::npos ? 1e-2f : 0.0f;
  return 1.0f / std::sqrt(static_cast<float>(i.shape.back()));
}
float constant_of(const V4ParamInfo& i) {
  const std::string& n = i.name;
  if (n.ends_with("norm.weight") || n.ends_with("q_weight") || n.ends_with("k_weight") || n.ends_with("_scale"))
    return 1.0f;
  return 0.0f;
}

void fill(float* x, int64_t n, const V4ParamInfo& i, uint64_t seed, uint64_t stream, int64_t first = 0) {
  const float s = std_of(i);
  if (s == 0) {
    std::fill(x, x + n, constant_of(i));
    return;
  }
  const Philox rng(seed, stream);
  for (int64_t k = 0; k < n; ++k) x[k] = s * rng.normal(static_cast<uint64_t>(first + k));
}

// Rows [r0, r1) of an fp8 matrix [rows, cols] with scale blocks of br x bc
// (the whole block rows: r0, r1 on block boundaries).
void encode_fp8(uint8_t* codes, uint8_t* scales, const float* x, int64_t rows, int64_t cols, int64_t br, int64_t bc) {
  const int64_t sc = (cols + bc - 1) / bc;
  for (int64_t r0 = 0; r0 < rows; r0 += br)
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      float amax = 0;
      for (int64_t r = r0; r < std::min(rows, r0 + br); ++r)
        for (int64_t k = c0; k < std::min(cols, c0 + bc); ++k) amax = std::max(amax, std::fabs(x[r * cols + k]));
      const uint8_t e = e8m0_for(amax, 448.0f);
      scales[(r0 / br) * sc + c0 / bc] = e;
      const float inv = 1.0f / e8m0_to_f32(e);
      for (int64_t r = r0; r < std::min(rows, r0 + br); ++r)
        for (int64_t k = c0; k < std::min(cols, c0 + bc); ++k)
          codes[r * cols + k] = f32_to_e4m3(std::clamp(x[r * cols + k] * inv, -448.0f, 448.0f));
    }
}

class Writer {
 public:
  Writer(const V4Config& c, uint64_t seed) : c_(c), seed_(seed) {}

  void plan() {
    for_each_v4_param(c_, [&](const V4ParamInfo& i) {
      const Store s = store_of(i, c_);
      const int64_t rows = i.shape[0], cols = i.shape.size() > 1 ? i.shape[1] : 1;
      const bool table = i.role == V4Role::EngramTable;
      switch (s) {
        case Store::BF16:
          add(i.name, "BF16", i.shape, 2);
          break;
        case Store::F32:
          add(i.name, "F32", i.shape, 4);
          break;
        case Store::Fp4:
          add(i.name, "I8", {rows, cols / 2}, 1);
          add(base(i.name) + ".scale", "F8_E8M0", {rows, cols / 32}, 1);
          break;
        case Store::Fp8: {
          const int64_t br = table ? 1 : c_.fp8_block_rows, bc = table ? 32 : c_.fp8_block_cols;
          add(i.name, "F8_E4M3", i.shape, 1);
          add(base(i.name) + ".scale", "F8_E8M0", {(rows + br - 1) / br, (cols + bc - 1) / bc}, 1);
          break;
        }
      }
    });
  }

  void write(const std::string& path) {
    nlohmann::json h = {{"__metadata__", {{"format", "pt"}}}};
    uint64_t off = 0;
    for (const Entry& e : entries_) {
      h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {off, off + e.bytes}}};
      off += e.bytes;
    }
    std::string header = h.dump();
    header.append((8 - header.size() % 8) % 8, ' ');
    io::AtomicFile f(path);
    const uint64_t len = header.size();
    f.write(&len, 8);
    f.write(header);
    uint64_t stream = 0;
    for_each_v4_param(c_, [&](const V4ParamInfo& i) { tensor(f, i, stream++); });
    f.commit();
  }

 private:
  static std::string base(const std::string& name) {
    return name.substr(0, name.size() - std::string(".weight").size());
  }
  void add(const std::string& name, const char* dtype, const Shape& shape, uint64_t size) {
    entries_.push_back({name, dtype, shape, static_cast<uint64_t>(shape_numel(shape)) * size});
  }

  void tensor(io::AtomicFile& f, const V4ParamInfo& i, uint64_t stream) {
    const Store s = store_of(i, c_);
    const int64_t rows = i.shape[0], cols = i.shape.size() > 1 ? i.shape[1] : 1;
    if (i.role == V4Role::EngramTable) return table(f, i, stream);
    std::vector<float> x(static_cast<size_t>(rows * cols));
    fill(x.data(), rows * cols, i, seed_, stream);
    if (s == Store::F32) return f.write(x.data(), x.size() * 4);
    if (s == Store::BF16) {
      std::vector<uint16_t> b(x.size());
      for (size_t k = 0; k < x.size(); ++k) b[k] = f32_to_bf16(x[k]);
      return f.write(b.data(), b.size() * 2);
    }
    if (s == Store::Fp4) {
      std::vector<uint8_t> packed(x.size() / 2), scales(x.size() / 32);
      for (size_t b = 0; b < scales.size(); ++b) {
        float amax = 0;
        for (size_t k = 32 * b; k < 32 * b + 32; ++k) amax = std::max(amax, std::fabs(x[k]));
        scales[b] = e8m0_for(amax, 6.0f);
        const float inv = 1.0f / e8m0_to_f32(scales[b]);
        for (size_t k = 32 * b; k < 32 * b + 32; k += 2)
          packed[k / 2] = static_cast<uint8_t>(f32_to_e2m1(x[k] * inv) | (f32_to_e2m1(x[k + 1] * inv) << 4));
      }
      f.write(packed.data(), packed.size());
      return f.write(scales.data(), scales.size());
    }
    const int64_t br = c_.fp8_block_rows, bc = c_.fp8_block_cols;
    std::vector<uint8_t> codes(x.size()), scales(static_cast<size_t>(((rows + br - 1) / br) * ((cols + bc - 1) / bc)));
    encode_fp8(codes.data(), scales.data(), x.data(), rows, cols, br, bc);
    f.write(codes.data(), codes.size());
    f.write(scales.data(), scales.size());
  }

  // The Engram table a chunk of rows at a time (its scales, 1/32 of it, held
  // until the codes are written).
  void table(io::AtomicFile& f, const V4ParamInfo& i, uint64_t stream) {
    const int64_t rows = i.shape[0], cols = i.shape[1], groups = (cols + 31) / 32;
    std::vector<uint8_t> scales(static_cast<size_t>(rows * groups));
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 24) / cols);
    std::vector<float> x;
    std::vector<uint8_t> codes;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      x.resize(static_cast<size_t>(n * cols));
      codes.resize(x.size());
      parallel_ranges(n, n > 64, [&](int64_t a, int64_t b) {
        fill(x.data() + a * cols, (b - a) * cols, i, seed_, stream, (r0 + a) * cols);
        encode_fp8(codes.data() + a * cols, scales.data() + (r0 + a) * groups, x.data() + a * cols, b - a, cols, 1, 32);
      });
      f.write(codes.data(), codes.size());
    }
    f.write(scales.data(), scales.size());
  }

  const V4Config& c_;
  uint64_t seed_;
  std::vector<Entry> entries_;
};

}  // namespace

void write_random_v41(const V4Config& cfg, const std::string& dir, uint64_t seed, const std::string& tokenizer_json) {
  DS_CHECK(cfg.v41(), "internal: write_random_v41 of a DeepSeek-V4 config");
  V4Config c = cfg;
  if (!c.engram_layers.empty()) {
    DS_CHECK(!tokenizer_json.empty() && fs::is_regular_file(tokenizer_json),
             "init: a DeepSeek-V4.1 model with Engram layers needs a tokenizer (--tokenizer tokenizer.json): its "
             "token classes are what the layers hash");
    // The classes this tokenizer gives, and tables as large as the primes need.
    const io::TokenClasses tc = io::engram_token_classes(io::Tokenizer::from_file(tokenizer_json), c.vocab_size);
    c.engram_compressed_vocab = tc.count;
    const auto tables = engram_hash_tables(c.engram_hash_spec());
    for (size_t e = 0; e < tables.size(); ++e) c.engram_num_embeddings[e] = tables[e].rows;
    c.validate();
  }
  prepare_model_folder(dir, "init");
  Writer w(c, seed);
  w.plan();
  w.write((fs::path(dir) / "model.safetensors").string());
  if (!tokenizer_json.empty())
    fs::copy_file(tokenizer_json, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
  nlohmann::json j = c.to_hf_json();
  j["dtype"] = "bfloat16";
  j["quantization_config"] = {{"quant_method", "fp8"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {c.fp8_block_rows, c.fp8_block_cols}},
                              {"scale_fmt", "ue8m0"},
                              {"expert_dtype", c.expert_dtype}};
  io::write_file_atomic((fs::path(dir) / "config.json").string(), j.dump(2) + "\n");
}

}  // namespace ds::model
