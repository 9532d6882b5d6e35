#include "model/quantize.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/buffer.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "model/init.h"
#include "model/load.h"
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

// What the recipe gives a tensor: a format, or "" to keep its dtype.
std::string recipe_format(const std::string& recipe, const ParamInfo& info) {
  const bool matrix = info.shape.size() == 2 && (info.role == ParamRole::Projection ||
                                                 info.role == ParamRole::Embedding || info.role == ParamRole::LmHead);
  // The V3.2 indexer's matrices stay as they are (its keys are rounded to
  // fp8 as DeepSeek's code rounds them; a coarser weight would move them).
  if (!matrix || info.name.find(".indexer.") != std::string::npos) return "";
  if (recipe == "q8_0") return "q8_0";
  if (recipe == "q4_k") return info.role == ParamRole::LmHead ? "q8_0" : "q4_k";
  // q4_k_m: the routed experts at 4 bits, everything read for every token at 8.
  return info.name.find(".mlp.experts.") != std::string::npos ? "q4_k" : "q8_0";
}

struct Item {
  ParamInfo info;
  ops::WeightView view;
  std::string format;  // q4_k, q8_0, or a float dtype's safetensors name (BF16, F32, F16)
  io::SafetensorsWriter::Entry entry;
};

bool is_block(const std::string& f) { return f == "q4_k" || f == "q4_1" || f == "q6_k" || f == "q8_0"; }
DType block_dtype(const std::string& f) {
  return f == "q4_k" ? DType::Q4_K : f == "q4_1" ? DType::Q4_1 : f == "q6_k" ? DType::Q6_K : DType::Q8_0;
}

// The stored float dtype a kept tensor is written in: its own, or bf16 for fp8.
std::string kept_dtype(const io::SafetensorsSet& st, const ParamInfo& info) {
  const std::string d = st.info(info.name).dtype_name;
  if (d == "F32" || d == "BF16" || d == "F16") return d;
  return info.shape.size() == 1 ? "F32" : "BF16";
}

Item plan(const io::SafetensorsSet& st, const ParamInfo& info, const ops::WeightView& v, const QuantizeOptions& opt,
          const std::vector<std::pair<std::regex, std::string>>& overrides, QuantizeReport& report) {
  std::string f = recipe_format(opt.recipe, info);
  for (const auto& [re, fmt] : overrides)
    if (std::regex_match(info.name, re)) {
      f = fmt;
      break;
    }
  const bool matrix = info.shape.size() == 2;
  DS_CHECK(matrix || f.empty() || f == "f32" || f == "bf16",
           "quantize: '{}' is a vector; only matrices may be stored as {}", info.name, f);
  const int64_t cols = matrix ? info.shape[1] : 0;
  auto fall = [&](const char* to) {
    report.fallbacks[fmt::format("{} -> {} ({} columns)", f, to, cols)] += 1;
    f = to;
  };
  if (f == "q4_k" && !ops::fits_block_format(DType::Q4_K, cols)) fall("q4_1");
  if (f == "q6_k" && !ops::fits_block_format(DType::Q6_K, cols)) fall("q8_0");
  if ((f == "q4_1" || f == "q8_0") && !ops::fits_block_format(DType::Q8_0, cols)) fall("bf16");
  Item it{info, v, f, {}};
  it.entry.name = info.name;
  if (is_block(f)) {
    const int64_t row_bytes = ops::block_row_bytes(block_dtype(f), cols);
    it.entry.dtype_name = "U8";
    it.entry.shape = {info.shape[0], row_bytes};
    it.entry.bytes = static_cast<uint64_t>(info.shape[0] * row_bytes);
    return it;
  }
  it.format = f == "bf16" ? "BF16" : f == "f32" ? "F32" : kept_dtype(st, info);
  it.entry.dtype_name = it.format;
  it.entry.shape = info.shape;
  it.entry.bytes = static_cast<uint64_t>(info.numel()) * (it.format == "F32" ? 4 : 2);
  return it;
}

// Streams one tensor: rows widened to float32 a chunk at a time, then
// quantized or converted, then written.
void write_item(io::SafetensorsWriter& w, const Item& it) {
  const int64_t rows = it.info.shape[0], cols = it.info.shape.size() == 2 ? it.info.shape[1] : 1;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{4} << 20) / cols);  // about 16 MiB of float32
  Buffer<float> wide;
  std::vector<uint8_t> bytes;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t r1 = std::min(rows, r0 + chunk), n = (r1 - r0) * cols;
    wide.resize(static_cast<size_t>(n));
    if (it.info.shape.size() == 1)
      std::copy_n(static_cast<const float*>(it.view.data) + r0, n, wide.data());
    else
      ops::widen_rows(wide.data(), it.view, r0, r1);
    if (is_block(it.format)) {
      const DType t = block_dtype(it.format);
      bytes.resize(static_cast<size_t>((r1 - r0) * ops::block_row_bytes(t, cols)));
      try {
        ops::quantize_rows(t, wide.data(), r1 - r0, cols, bytes.data());
      } catch (const Error& e) {
        throw Error(fmt::format("quantize: tensor '{}': {}", it.info.name, e.what()));
      }
    } else {
      const DType t = it.format == "F32" ? DType::F32 : it.format == "F16" ? DType::F16 : DType::BF16;
      bytes.resize(static_cast<size_t>(n) * dtype_size(t));
      convert(bytes.data(), t, wide.data(), DType::F32, static_cast<size_t>(n));
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

QuantizeReport quantize_model(const std::string& in, const std::string& out, const QuantizeOptions& opt) {
  DS_CHECK(opt.recipe == "q8_0" || opt.recipe == "q4_k" || opt.recipe == "q4_k_m",
           "quantize: --type '{}' is not one of q4_k_m, q4_k, q8_0", opt.recipe);
  std::vector<std::pair<std::regex, std::string>> overrides;
  for (const auto& [re, f] : opt.overrides)
    overrides.emplace_back(std::regex(parse_quantize_override(re + "=" + f).first), f);
  std::error_code ec;
  DS_CHECK(!fs::exists(out) || !fs::equivalent(in, out, ec), "quantize: --out '{}' is the input folder", out);
  const json source = json::parse(io::read_file((fs::path(in) / "config.json").string(), "config"), nullptr, false);
  DS_CHECK(source.is_object(), "quantize: '{}/config.json' is not a JSON object", in);
  const std::string type = source.value("model_type", "");
  DS_CHECK(type.rfind("deepseek_v4", 0) != 0,
           "quantize: '{}' is a DeepSeek-V4 folder ({}); quantize reads DeepSeek-V2/V3/V3.2 folders (V4 ships its own "
           "fp8 and fp4 weights)",
           in, type);
  const ModelConfig cfg = load_config(in);
  DS_CHECK(cfg.mhc_expansion_rate <= 1, "quantize: mHC models are not supported");
  const io::SafetensorsSet st = io::SafetensorsSet::open_dir(in);
  const std::string mtp_name = fmt::format("model.layers.{}.eh_proj.weight", cfg.num_hidden_layers);
  const int64_t mtp = cfg.num_nextn_predict_layers > 0 && st.contains(mtp_name) ? cfg.num_nextn_predict_layers : 0;
  const ModelWeights weights = ModelWeights::load(st, cfg, mtp);

  QuantizeReport report;
  std::vector<Item> items;
  for_each_param(
      cfg, mtp,
      [&](const ParamInfo& info, const ops::WeightView& v) {
        items.push_back(plan(st, info, v, opt, overrides, report));
      },
      weights.view);
  prepare_model_folder(out, "quantize");
  std::vector<io::SafetensorsWriter::Entry> entries;
  for (const auto& it : items) entries.push_back(it.entry);
  io::SafetensorsWriter w((fs::path(out) / "model.safetensors").string(), entries, {{"format", "pt"}});
  for (const auto& it : items) {
    write_item(w, it);
    const std::string f = is_block(it.format)  ? it.format
                          : it.format == "F32" ? "f32"
                          : it.format == "F16" ? "f16"
                                               : "bf16";
    report.tensors[f] += 1;
    report.bytes[f] += it.entry.bytes;
    report.bytes_out += it.entry.bytes;
  }
  report.bytes_in = weights.weight_bytes;
  w.commit();

  json config = source;
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
