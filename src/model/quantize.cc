#include "model/quantize.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/buffer.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "model/init.h"
#include "model/load.h"
#include "model/v4_weights.h"
#include "model/weights.h"
#include "ops/block_quant.h"
#include "ops/linear.h"

namespace ds::model {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::vector<std::string>& formats() {
  static const std::vector<std::string> f = {"q4_k", "q4_1", "q6_k", "q8_0", "bf16", "f32"};
  return f;
}

// One tensor of the source as quantize sees it.
struct Source {
  std::string name;
  Shape shape;
  ops::WeightView view;  // matrices: any format widen_rows reads; vectors: float32; kept: its bytes
  // kKept: written byte for byte in `kept` (V4's tid2eid as I32, V4.1's
  // Engram tables and their E8M0 scales, which stay on disk when served).
  enum Kind { kMatrix, kVector, kKept } kind = kMatrix;
  bool recipe = false;         // a matrix the recipe quantizes (projections, the embedding, the head)
  bool routed_expert = false;  // quantized to 4 bits by q4_k_m
  bool head = false;           // kept at 8 bits by q4_k
  std::string kept;            // the dtype it is written in when nothing quantizes it
};

// What the recipe gives a tensor: a format, or "" to keep it as it is.
std::string recipe_format(const std::string& recipe, const Source& t) {
  if (!t.recipe) return "";
  if (recipe == "q8_0") return "q8_0";
  if (recipe == "q4_k") return t.head ? "q8_0" : "q4_k";
  // q4_k_m: the routed experts at 4 bits, everything read for every token at 8.
  return t.routed_expert ? "q4_k" : "q8_0";
}

struct Item {
  Source src;
  std::string format;  // q4_k, q8_0, ..., or a safetensors dtype name (BF16, F32, F16, I32, F8_E4M3, ...)
  io::SafetensorsWriter::Entry entry;
};

bool is_block(const std::string& f) { return f == "q4_k" || f == "q4_1" || f == "q6_k" || f == "q8_0"; }
DType block_dtype(const std::string& f) {
  return f == "q4_k" ? DType::Q4_K : f == "q4_1" ? DType::Q4_1 : f == "q6_k" ? DType::Q6_K : DType::Q8_0;
}

// The dtype a kept tensor is written in: its own float dtype, else `other`
// (matrices: bf16 for fp8, fp4 and blocks, whose scales have no place
// beside the blocks; vectors: float32).
std::string kept_float(const std::string& dtype, const char* other = "BF16") {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" ? dtype : other;
}

// The V3.2 indexer's matrices (and V4's) stay as they are: its keys are
// rounded as DeepSeek's code rounds them, and a coarser weight would move them.
bool indexer(const std::string& name) { return name.find(".indexer.") != std::string::npos; }

Item plan(const Source& t, const QuantizeOptions& opt, const std::vector<std::pair<std::regex, std::string>>& overrides,
          QuantizeReport& report) {
  std::string f = recipe_format(opt.recipe, t);
  for (const auto& [re, fmt] : overrides)
    if (std::regex_match(t.name, re)) {
      f = fmt;
      break;
    }
  if (t.kind == Source::kKept) {  // kept as it is: a float override (".*=f32") passes it by
    DS_CHECK(!is_block(f), "quantize: '{}' is a table kept as it is; only matrices may be stored as {}", t.name, f);
    f.clear();
  }
  DS_CHECK(t.kind == Source::kMatrix || f.empty() || f == "f32" || f == "bf16",
           "quantize: '{}' is a vector; only matrices may be stored as {}", t.name, f);
  const int64_t cols = t.kind == Source::kMatrix ? t.shape[1] : 0;
  auto fall = [&](const char* to) {
    report.fallbacks[fmt::format("{} -> {} ({} columns)", f, to, cols)] += 1;
    f = to;
  };
  if (f == "q4_k" && !ops::fits_block_format(DType::Q4_K, cols)) fall("q4_1");
  if (f == "q6_k" && !ops::fits_block_format(DType::Q6_K, cols)) fall("q8_0");
  if ((f == "q4_1" || f == "q8_0") && !ops::fits_block_format(DType::Q8_0, cols)) fall("bf16");
  Item it{t, f, {}};
  it.entry.name = t.name;
  if (is_block(f)) {
    const int64_t row_bytes = ops::block_row_bytes(block_dtype(f), cols);
    it.entry.dtype_name = "U8";
    it.entry.shape = {t.shape[0], row_bytes};
    it.entry.bytes = static_cast<uint64_t>(t.shape[0] * row_bytes);
    return it;
  }
  it.format = f == "bf16" ? "BF16" : f == "f32" ? "F32" : t.kept;
  it.entry.dtype_name = it.format;
  it.entry.shape = t.shape;
  const uint64_t size = it.format == "BF16" || it.format == "F16"          ? 2
                        : it.format == "F8_E4M3" || it.format == "F8_E8M0" ? 1
                                                                           : 4;
  it.entry.bytes = static_cast<uint64_t>(shape_numel(t.shape)) * size;
  return it;
}

// Streams one tensor: rows widened to float32 a chunk at a time, then
// quantized or converted, then written.
void write_item(io::SafetensorsWriter& w, const Item& it) {
  const Source& t = it.src;
  if (t.kind == Source::kKept) {
    w.write(static_cast<const uint8_t*>(t.view.data), it.entry.bytes);
    return;
  }
  const int64_t rows = t.shape[0], cols = t.kind == Source::kMatrix ? t.shape[1] : shape_numel(t.shape) / rows;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{4} << 20) / cols);  // about 16 MiB of float32
  Buffer<float> wide;
  std::vector<uint8_t> bytes;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t r1 = std::min(rows, r0 + chunk), n = (r1 - r0) * cols;
    wide.resize(static_cast<size_t>(n));
    if (t.kind == Source::kVector)
      std::copy_n(static_cast<const float*>(t.view.data) + r0 * cols, n, wide.data());
    else
      ops::widen_rows(wide.data(), t.view, r0, r1);
    if (is_block(it.format)) {
      const DType b = block_dtype(it.format);
      bytes.resize(static_cast<size_t>((r1 - r0) * ops::block_row_bytes(b, cols)));
      try {
        ops::quantize_rows(b, wide.data(), r1 - r0, cols, bytes.data());
      } catch (const Error& e) {
        throw Error(fmt::format("quantize: tensor '{}': {}", t.name, e.what()));
      }
    } else {
      const DType f = it.format == "F32" ? DType::F32 : it.format == "F16" ? DType::F16 : DType::BF16;
      bytes.resize(static_cast<size_t>(n) * dtype_size(f));
      convert(bytes.data(), f, wide.data(), DType::F32, static_cast<size_t>(n));
    }
    w.write(bytes.data(), bytes.size());
  }
}

// The input folder's other files (tokenizer, chat template, generation
// config, ...) into out.
void copy_side_files(const std::string& in, const std::string& out) {
  for (const auto& e : fs::directory_iterator(in)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")) continue;
    std::error_code ec;
    fs::copy(e.path(), fs::path(out) / name, fs::copy_options::recursive | fs::copy_options::overwrite_existing, ec);
    DS_CHECK(!ec, "quantize: cannot copy '{}' into '{}': {}", e.path().string(), out, ec.message());
  }
}

}  // namespace

std::pair<std::string, std::string> parse_quantize_override(const std::string& text) {
  const size_t eq = text.rfind('=');
  DS_CHECK(eq != std::string::npos && eq > 0, "--override '{}' is not REGEX=FORMAT", text);
  const std::string re = text.substr(0, eq), f = text.substr(eq + 1);
  DS_CHECK(std::find(formats().begin(), formats().end(), f) != formats().end(),
           "--override '{}': format '{}' is not one of q4_k, q4_1, q8_0, bf16, f32", text, f);
  try {
    std::regex check(re);
  } catch (const std::regex_error& e) {
    DS_FAIL("--override '{}': '{}' is not a regular expression ({})", text, re, e.what());
  }
  return {re, f};
}

// A source folder's tensors, in the order they are written, over its
// loaded weights (which the views point into).
struct Loaded {
  io::SafetensorsSet st;
  std::unique_ptr<ModelWeights> v3;
  std::unique_ptr<V4Weights> v4;
  std::vector<Source> tensors;
  size_t weight_bytes = 0;
};

std::unique_ptr<Loaded> load_v3(const std::string& in) {
  const ModelConfig cfg = load_config(in);
  auto m = std::make_unique<Loaded>();
  m->st = io::SafetensorsSet::open_dir(in);
  const std::string mtp_name = fmt::format("model.layers.{}.eh_proj.weight", cfg.num_hidden_layers);
  const int64_t mtp = cfg.num_nextn_predict_layers > 0 && m->st.contains(mtp_name) ? cfg.num_nextn_predict_layers : 0;
  m->v3 = std::make_unique<ModelWeights>(ModelWeights::load(m->st, cfg, mtp));
  m->weight_bytes = m->v3->weight_bytes;
  for_each_param(
      cfg, mtp,
      [&](const ParamInfo& info, const ops::WeightView& v) {
        Source t{info.name, info.shape, v, Source::kMatrix, false, false, false, ""};
        const bool matrix = info.shape.size() == 2;
        t.kind = matrix ? Source::kMatrix : Source::kVector;
        t.recipe =
            matrix && !indexer(info.name) &&
            (info.role == ParamRole::Projection || info.role == ParamRole::Embedding || info.role == ParamRole::LmHead);
        t.routed_expert = info.name.find(".mlp.experts.") != std::string::npos;
        t.head = info.role == ParamRole::LmHead;
        t.kept = kept_float(m->st.info(info.name).dtype_name, matrix ? "BF16" : "F32");
        m->tensors.push_back(std::move(t));
      },
      m->v3->view);
  return m;
}

// A V4.1 Engram table as it is stored (it stays on disk when served, read a
// row at a time): its e4m3 codes and E8M0 scales, or its float values.
void keep_engram_table(Source t, std::vector<Source>& out) {
  const ops::WeightView& v = t.view;
  t.kind = Source::kKept;
  if (v.dtype != DType::F8E4M3) {
    t.kept = v.dtype == DType::F32 ? "F32" : v.dtype == DType::F16 ? "F16" : "BF16";
    out.push_back(std::move(t));
    return;
  }
  t.kept = "F8_E4M3";
  Source scale = t;
  scale.name = t.name.substr(0, t.name.size() - std::string(".weight").size()) + ".scale";
  scale.shape = {v.rows, (v.cols + 31) / 32};
  scale.view.data = v.scale_e8m0;
  scale.kept = "F8_E8M0";
  out.push_back(std::move(t));
  out.push_back(std::move(scale));
}

// DeepSeek-V4 and V4.1: written under the upstream names, whatever spelling
// the source used; vectors (norms, mHC mixes, sinks, biases) as float32,
// tid2eid as int32, Engram tables as they are. What the text model does not
// read (V4.1's DSpark draft stages and vision tower) is left out.
std::unique_ptr<Loaded> load_v4(const std::string& in, json& config) {
  V4Config cfg = V4Config::from_hf_json_text(config.dump(), in + "/config.json");
  auto m = std::make_unique<Loaded>();
  m->st = io::SafetensorsSet::open_dir(in);
  cfg.num_nextn_predict_layers = v4_stored_mtp_layers(m->st, cfg);
  m->v4 = std::make_unique<V4Weights>(V4Weights::load(m->st, cfg));
  m->weight_bytes = m->v4->weight_bytes;
  for_each_v4_param(
      cfg,
      [&](const V4ParamInfo& info, const ops::WeightView& v) {
        Source t{info.name, info.shape, v, Source::kMatrix, false, false, false, ""};
        if (info.role == V4Role::EngramTable) return keep_engram_table(t, m->tensors);
        const bool matrix = info.role != V4Role::Vector && info.role != V4Role::HashTable;
        t.kind = info.role == V4Role::HashTable ? Source::kKept : matrix ? Source::kMatrix : Source::kVector;
        t.recipe = !indexer(info.name) &&
                   (info.role == V4Role::Projection || info.role == V4Role::Embedding || info.role == V4Role::LmHead);
        t.routed_expert = info.routed_expert;
        t.head = info.role == V4Role::LmHead;
        t.kept = t.kind == Source::kKept     ? "I32"
                 : t.kind == Source::kVector ? "F32"
                 : v.dtype == DType::F32     ? "F32"
                 : v.dtype == DType::F16     ? "F16"
                                             : "BF16";
        m->tensors.push_back(std::move(t));
      },
      m->v4->view);
  // The experts are blocks now (or what an override makes them): no
  // expert_dtype, and V4.1's text_config reads the root's quantization_config.
  config.erase("expert_dtype");
  if (config.contains("text_config") && config["text_config"].is_object()) {
    config["text_config"].erase("expert_dtype");
    config["text_config"].erase("quantization_config");
  }
  return m;
}

QuantizeReport quantize_model(const std::string& in, const std::string& out, const QuantizeOptions& opt) {
  DS_CHECK(opt.recipe == "q8_0" || opt.recipe == "q4_k" || opt.recipe == "q4_k_m",
           "quantize: --type '{}' is not one of q4_k_m, q4_k, q8_0", opt.recipe);
  std::vector<std::pair<std::regex, std::string>> overrides;
  for (const auto& [re, f] : opt.overrides)
    overrides.emplace_back(std::regex(parse_quantize_override(re + "=" + f).first), f);
  std::error_code ec;
  DS_CHECK(!fs::exists(out) || !fs::equivalent(in, out, ec), "quantize: --out '{}' is the input folder", out);
  json config = json::parse(io::read_file((fs::path(in) / "config.json").string(), "config"), nullptr, false);
  DS_CHECK(config.is_object(), "quantize: '{}/config.json' is not a JSON object", in);
  const std::string type = config.value("model_type", "");
  const auto src = type.rfind("deepseek_v4", 0) == 0 ? load_v4(in, config) : load_v3(in);

  QuantizeReport report;
  std::vector<Item> items;
  for (const Source& t : src->tensors) items.push_back(plan(t, opt, overrides, report));
  prepare_model_folder(out, "quantize");
  std::vector<io::SafetensorsWriter::Entry> entries;
  for (const auto& it : items) entries.push_back(it.entry);
  io::SafetensorsWriter w((fs::path(out) / "model.safetensors").string(), entries, {{"format", "pt"}});
  for (const auto& it : items) {
    write_item(w, it);
    std::string f = it.format;  // the report's names: q8_0, bf16, f32, i32, f8_e4m3, ...
    std::transform(f.begin(), f.end(), f.begin(), [](unsigned char c) { return std::tolower(c); });
    report.tensors[f] += 1;
    report.bytes[f] += it.entry.bytes;
    report.bytes_out += it.entry.bytes;
  }
  report.bytes_in = src->weight_bytes;
  w.commit();

  json counts = json::object();
  for (const auto& [f, n] : report.tensors) counts[f] = n;
  config["quantization_config"] = {
      {"quant_method", "deepseek_cpp"},
      {"format_version", 1},
      {"recipe", opt.recipe},
      {"formats",
       {{"q8_0", "U8 rows of blocks of 32 values, 34 bytes: f16 d, 32 int8 q; x = d q (ggml's Q8_0)"},
        {"q4_k",
         "U8 rows of blocks of 256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of 8 "
         "sub-blocks of 32, 128 bytes of 4-bit codes; x = d sc q - dmin m (ggml's Q4_K)"},
        {"q4_1",
         "U8 rows of blocks of 32 values, 20 bytes: f16 d, f16 m, 16 bytes of 4-bit codes; x = d q + m "
         "(ggml's Q4_1)"},
        {"q6_k",
         "U8 rows of blocks of 256 values, 210 bytes: 128 bytes of the 6-bit codes' low 4 bits, 64 of their "
         "high 2 bits, 16 int8 scales (one per 16 values), f16 d; x = d sc (q - 32) (ggml's Q6_K)"}}},
      {"tensors", counts}};
  if (!opt.overrides.empty()) {
    json o = json::array();
    for (const auto& [re, f] : opt.overrides) o.push_back(re + "=" + f);
    config["quantization_config"]["overrides"] = o;
  }
  io::write_file_atomic((fs::path(out) / "config.json").string(), config.dump(2) + "\n");
  copy_side_files(in, out);
  return report;
}

}  // namespace ds::model
