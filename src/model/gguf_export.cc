#include "model/gguf_export.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "model/load.h"
#include "ops/block_quant.h"

namespace ds::model {

namespace {

namespace fs = std::filesystem;
namespace gguf = io::gguf;
using gguf::TensorType;
using json = nlohmann::json;

// The llama.cpp pre-tokenizer name for a tokenizer.json's pre_tokenizer.
std::string pre_tokenizer_name(const json& pre, const std::string& path) {
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers")) {
    std::vector<std::string> splits;
    bool byte_level = false;
    for (const auto& p : pre["pretokenizers"]) {
      const std::string t = p.value("type", "");
      if (t == "Split" && p.contains("pattern") && p["pattern"].contains("Regex"))
        splits.push_back(p["pattern"]["Regex"].get<std::string>());
      else if (t == "ByteLevel")
        byte_level = !p.value("use_regex", true);
    }
    if (byte_level && splits == deepseek_v3_pre_splits())
      return "deepseek-v3";
  }
  if (pre.is_object() && pre.value("type", "") == "ByteLevel" && pre.value("use_regex", false)) return "gpt-2";
  DS_FAIL("gguf export: {}: its pre-tokenizer is neither DeepSeek-V3's nor GPT-2's, so llama.cpp would split text "
          "differently",
          path);
}

// tokenizer.ggml.* from tokenizer.json (byte-level BPE).
void write_tokenizer(gguf::Writer& w, const std::string& dir, const ModelConfig& c) {
  const std::string path = (fs::path(dir) / "tokenizer.json").string();
  const json t = json::parse(io::read_file(path, "tokenizer"));
  DS_CHECK(t.contains("model") && t["model"].value("type", "") == "BPE" && t["model"].contains("vocab"),
           "gguf export: {} is not a byte-level BPE tokenizer", path);
  std::vector<std::string> tokens(static_cast<size_t>(c.vocab_size));
  std::vector<int32_t> types(tokens.size(), 5);  // UNUSED: ids no token has
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = fmt::format("[PAD{}]", i);
  auto put = [&](int64_t id, const std::string& text, int32_t type) {
    DS_CHECK(id >= 0 && id < c.vocab_size, "gguf export: {}: token id {} outside the model's vocabulary of {}", path,
             id, c.vocab_size);
    tokens[static_cast<size_t>(id)] = text;
    types[static_cast<size_t>(id)] = type;
  };
  for (const auto& [text, id] : t["model"]["vocab"].items()) put(id.get<int64_t>(), text, 1);  // NORMAL
  if (t.contains("added_tokens"))
    for (const auto& a : t["added_tokens"])
      put(a["id"].get<int64_t>(), a["content"].get<std::string>(), a.value("special", false) ? 3 : 4);  // CONTROL, USER
  std::vector<std::string> merges;
  for (const auto& m : t["model"].value("merges", json::array())) {
    if (m.is_string()) {
      merges.push_back(m.get<std::string>());
    } else {
      DS_CHECK(m.is_array() && m.size() == 2, "gguf export: {}: a merge that is neither \"a b\" nor [a, b]", path);
      merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    }
  }
  w.set("tokenizer.ggml.model", gguf::Value::str("gpt2"));
  w.set("tokenizer.ggml.pre", gguf::Value::str(pre_tokenizer_name(t.value("pre_tokenizer", json()), path)));
  w.set("tokenizer.ggml.tokens", gguf::Value::strings(std::move(tokens)));
  w.set("tokenizer.ggml.token_type", gguf::Value::i32s(types));
  w.set("tokenizer.ggml.merges", gguf::Value::strings(std::move(merges)));
  w.set("tokenizer.ggml.bos_token_id", gguf::Value::u32(static_cast<uint32_t>(c.bos_token_id)));
  w.set("tokenizer.ggml.eos_token_id", gguf::Value::u32(static_cast<uint32_t>(c.eos_token_id)));
  w.set("tokenizer.ggml.add_bos_token", gguf::Value::boolean(true));
  w.set("tokenizer.ggml.add_eos_token", gguf::Value::boolean(false));
}

void write_hparams(gguf::Writer& w, const ModelConfig& c, uint32_t file_type) {
  const std::string a = "deepseek2.";
  auto u32 = [](int64_t v) { return gguf::Value::u32(static_cast<uint32_t>(v)); };
  auto f32 = [](double v) { return gguf::Value::f32(static_cast<float>(v)); };
  w.set("general.architecture", gguf::Value::str("deepseek2"));
  w.set("general.type", gguf::Value::str("model"));
  w.set("general.name", gguf::Value::str("deepseek.cpp export"));
  w.set("general.file_type", gguf::Value::u32(file_type));
  w.set("general.quantization_version", gguf::Value::u32(2));
  w.set(a + "block_count", u32(c.num_hidden_layers));
  w.set(a + "context_length", u32(c.max_position_embeddings));
  w.set(a + "embedding_length", u32(c.hidden_size));
  w.set(a + "feed_forward_length", u32(c.intermediate_size));
  w.set(a + "attention.head_count", u32(c.num_attention_heads));
  w.set(a + "attention.head_count_kv", u32(1));
  w.set(a + "rope.freq_base", f32(c.rope_theta));
  w.set(a + "attention.layer_norm_rms_epsilon", f32(c.rms_norm_eps));
  w.set(a + "leading_dense_block_count", u32(c.first_k_dense_replace));
  w.set(a + "vocab_size", u32(c.vocab_size));
  if (c.q_lora_rank > 0) w.set(a + "attention.q_lora_rank", u32(c.q_lora_rank));
  w.set(a + "attention.kv_lora_rank", u32(c.kv_lora_rank));
  w.set(a + "attention.key_length", u32(c.kv_lora_rank + c.qk_rope_head_dim));
  w.set(a + "attention.value_length", u32(c.kv_lora_rank));
  w.set(a + "attention.key_length_mla", u32(c.qk_nope_head_dim + c.qk_rope_head_dim));
  w.set(a + "attention.value_length_mla", u32(c.v_head_dim));
  w.set(a + "rope.dimension_count", u32(c.qk_rope_head_dim));
  if (c.n_routed_experts > 0) {
    w.set(a + "expert_feed_forward_length", u32(c.moe_intermediate_size));
    w.set(a + "expert_count", u32(c.n_routed_experts));
    w.set(a + "expert_used_count", u32(c.num_experts_per_tok));
    w.set(a + "expert_shared_count", u32(c.n_shared_experts));
    w.set(a + "expert_weights_scale", f32(c.routed_scaling_factor));
    if (c.norm_topk_prob) w.set(a + "expert_weights_norm", gguf::Value::boolean(true));
    w.set(a + "expert_gating_func", u32(c.scoring_func == ScoringFunc::Sigmoid ? 2 : 1));
    // llama.cpp asserts topk_group < n_group when it routes by groups.
    if (c.n_group > 1 && c.topk_group < c.n_group) {
      w.set(a + "expert_group_count", u32(c.n_group));
      w.set(a + "expert_group_used_count", u32(c.topk_group));
    }
  }
  if (c.rope_scaling.enabled) {
    w.set(a + "rope.scaling.type", gguf::Value::str("yarn"));
    w.set(a + "rope.scaling.factor", f32(c.rope_scaling.factor));
    w.set(a + "rope.scaling.original_context_length", u32(c.rope_scaling.original_max_position_embeddings));
    w.set(a + "rope.scaling.yarn_beta_fast", f32(c.rope_scaling.beta_fast));
    w.set(a + "rope.scaling.yarn_beta_slow", f32(c.rope_scaling.beta_slow));
    w.set(a + "rope.scaling.yarn_log_multiplier", f32(0.1 * c.rope_scaling.mscale_all_dim));
  }
}

// One tensor's bytes in `type` from float32 rows of `ne0` values.
std::string encode(const std::vector<float>& x, int64_t ne0, TensorType type) {
  std::string out;
  if (type == TensorType::F32) {
    out.assign(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  } else if (type == TensorType::BF16 || type == TensorType::F16) {
    out.resize(x.size() * 2);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t h = type == TensorType::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  } else {
    // Q8_0, Q4_K, Q4_1, Q6_K: ggml's blocks, made by this engine's
    // quantizer (ops/block_quant.h; its Q8_0 is ggml's quantize_row_q8_0_ref).
    const DType t = type == TensorType::Q4_K   ? DType::Q4_K
                    : type == TensorType::Q4_1 ? DType::Q4_1
                    : type == TensorType::Q6_K ? DType::Q6_K
                                               : DType::Q8_0;
    DS_CHECK((type == TensorType::Q4_K || type == TensorType::Q4_1 || type == TensorType::Q8_0 ||
              type == TensorType::Q6_K) &&
                 ops::fits_block_format(t, ne0),
             "gguf export: cannot encode rows of {} in {}", ne0, gguf::type_name(type));
    const int64_t rows = static_cast<int64_t>(x.size()) / ne0;
    out.resize(static_cast<size_t>(rows * ops::block_row_bytes(t, ne0)));
    ops::quantize_rows(t, x.data(), rows, ne0, reinterpret_cast<uint8_t*>(out.data()));
  }
  return out;
}

// Tensors are added with what makes their values, and read, converted and
// encoded only when the file is written: one tensor in memory at a time.
// Every source tensor is checked (present, float, its size) when added, so a
// bad folder is refused before anything is written.
// The type of a GGUF matrix under a recipe (model/quantize.h's, by ggml's
// names): q4_k_m puts the routed experts at 4 bits and the rest at q8_0,
// q4_k every matrix but the output. Rows that are not whole blocks fall
// back: Q4_K to Q4_1, Q6_K to Q8_0, Q4_1 and Q8_0 to F16 (llama.cpp's
// converter writes F16 there too).
TensorType matrix_type(const std::string& recipe, TensorType plain, const std::string& name, int64_t ne0) {
  TensorType t = plain;
  if (recipe == "q4_k_m") t = name.find("_exps.") != std::string::npos ? TensorType::Q4_K : TensorType::Q8_0;
  if (recipe == "q4_k") t = name == "output.weight" ? TensorType::Q8_0 : TensorType::Q4_K;
  if (t == TensorType::Q4_K && ne0 % ops::kQ4_KValues != 0) t = TensorType::Q4_1;
  if (t == TensorType::Q6_K && ne0 % ops::kQ6_KValues != 0) t = TensorType::Q8_0;
  if ((t == TensorType::Q4_1 || t == TensorType::Q8_0) && ne0 % 32 != 0) t = TensorType::F16;
  return t;
}

// The format of a block-quantized tensor (a `deepseek quantize` folder's U8
// rows) of `cols` columns, from its bytes a row; F32 if none matches.
DType block_format(const io::TensorInfo& i, int64_t cols) {
  for (DType f : ops::kBlockFormats)
    if (i.shape.size() == 2 && ops::fits_block_format(f, cols) && ops::block_row_bytes(f, cols) == i.shape[1]) return f;
  return DType::F32;
}

class Exporter {
 public:
  Exporter(const std::string& dir, TensorType type, std::string recipe)
      : files_(io::SafetensorsSet::open_dir(dir)), type_(type), recipe_(std::move(recipe)) {}

  // Checks an HF tensor of `numel` values the export will read.
  void need(const std::string& name, int64_t numel) const {
    DS_CHECK(files_.contains(name), "gguf export: the folder has no tensor '{}'", name);
    const io::TensorInfo& i = files_.info(name);
    if (i.dtype_name == "U8") {  // q8_0 / q4_k / q4_1 rows of a quantized folder
      const int64_t rows = i.shape.empty() ? 0 : i.shape[0];
      DS_CHECK(rows > 0 && numel % rows == 0 && block_format(i, numel / rows) != DType::F32,
               "gguf export: tensor '{}' is U8 {} but not the blocks of {} values", name, shape_str(i.shape), numel);
      return;
    }
    const Tensor t = files_.tensor(name);
    DS_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16,
             "gguf export: tensor '{}' is {}; export float folders (fp8 checkpoints are not converted)", name,
             dtype_name(t.dtype()));
    DS_CHECK(t.numel() == numel, "gguf export: tensor '{}' has {} values, not {}", name, t.numel(), numel);
  }
  // An HF tensor as float32 in its row-major order (ne0 its last dim);
  // blocks dequantized.
  std::vector<float> get(const std::string& name) const {
    const io::TensorInfo& i = files_.info(name);
    if (i.dtype_name != "U8") return files_.tensor(name).to_vector();
    const int64_t rows = i.shape[0], cols = shape(name)[1];
    std::vector<float> out(static_cast<size_t>(rows * cols));
    ops::dequantize_blocks(block_format(i, cols), files_.bytes(name), rows * cols, out.data());
    return out;
  }
  // The logical shape of an HF tensor (blocks: their matrix's).
  Shape shape(const std::string& name) const {
    const io::TensorInfo& i = files_.info(name);
    if (i.dtype_name != "U8") return i.shape;
    DS_CHECK(i.shape.size() == 2, "gguf export: tensor '{}' is U8 {}, not rows of blocks", name, shape_str(i.shape));
    for (DType f : ops::kBlockFormats)
      if (i.shape[1] % ops::block_bytes(f) == 0) {
        const int64_t cols = i.shape[1] / ops::block_bytes(f) * ops::block_values(f);
        if (block_format(i, cols) == f) return {i.shape[0], cols};
      }
    DS_FAIL("gguf export: tensor '{}' is U8 {}, not rows of q8_0, q4_k, q4_1 or q6_k blocks", name, shape_str(i.shape));
  }
  // Adds a tensor of ggml shape ne (fastest first) whose values `make`
  // gives; `keep_f32` for norms, biases and the router.
  void add(gguf::Writer& w, const std::string& name, std::vector<int64_t> ne, bool keep_f32,
           std::function<std::vector<float>()> make) const {
    TensorType t = keep_f32 || ne.size() == 1 ? TensorType::F32 : matrix_type(recipe_, type_, name, ne[0]);
    const int64_t ne0 = ne[0];
    w.add_tensor(name, t, std::move(ne), [make = std::move(make), ne0, t](auto put) {
      const std::string bytes = encode(make(), ne0, t);
      put(bytes.data(), bytes.size());
    });
  }
  void matrix(gguf::Writer& w, const std::string& name, const std::string& hf, bool keep_f32 = false) const {
    DS_CHECK(files_.contains(hf), "gguf export: the folder has no tensor '{}'", hf);
    const auto shape = this->shape(hf);
    DS_CHECK(shape.size() <= 2, "gguf export: tensor '{}' has {} dims", hf, shape.size());
    std::vector<int64_t> ne(shape.rbegin(), shape.rend());
    int64_t n = 1;
    for (int64_t d : ne) n *= d;
    need(hf, n);
    add(w, name, std::move(ne), keep_f32, [this, hf] { return get(hf); });
  }

 private:
  io::SafetensorsSet files_;
  TensorType type_;
  std::string recipe_;
};

void write_layer(gguf::Writer& w, Exporter& e, const ModelConfig& c, int64_t l) {
  const std::string b = fmt::format("blk.{}.", l), h = fmt::format("model.layers.{}.", l);
  e.matrix(w, b + "attn_norm.weight", h + "input_layernorm.weight", true);
  e.matrix(w, b + "ffn_norm.weight", h + "post_attention_layernorm.weight", true);
  if (c.q_lora_rank > 0) {
    e.matrix(w, b + "attn_q_a.weight", h + "self_attn.q_a_proj.weight");
    e.matrix(w, b + "attn_q_a_norm.weight", h + "self_attn.q_a_layernorm.weight", true);
    e.matrix(w, b + "attn_q_b.weight", h + "self_attn.q_b_proj.weight");
  } else {
    e.matrix(w, b + "attn_q.weight", h + "self_attn.q_proj.weight");
  }
  e.matrix(w, b + "attn_kv_a_mqa.weight", h + "self_attn.kv_a_proj_with_mqa.weight");
  e.matrix(w, b + "attn_kv_a_norm.weight", h + "self_attn.kv_a_layernorm.weight", true);
  // kv_b_proj [H (nope + v), kvl]: per head, k_b transposed to [kvl, nope]
  // rows (ggml ne (nope, kvl, H)) and v_b as it is (ne (kvl, v, H)).
  const int64_t H = c.num_attention_heads, nope = c.qk_nope_head_dim, vd = c.v_head_dim, kvl = c.kv_lora_rank;
  const std::string kv_b = h + "self_attn.kv_b_proj.weight";
  e.need(kv_b, H * (nope + vd) * kvl);
  // attn_k_b[d, col, h] = kv_b[h (nope + v) + d, col]; attn_v_b[col, j, h] = kv_b[h (nope + v) + nope + j, col].
  e.add(w, b + "attn_k_b.weight", {nope, kvl, H}, false, [&e, kv_b, H, nope, vd, kvl] {
    const auto kvb = e.get(kv_b);
    std::vector<float> kb(static_cast<size_t>(H * kvl * nope));
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t d = 0; d < nope; ++d)
        for (int64_t col = 0; col < kvl; ++col)
          kb[static_cast<size_t>((hh * kvl + col) * nope + d)] =
              kvb[static_cast<size_t>((hh * (nope + vd) + d) * kvl + col)];
    return kb;
  });
  e.add(w, b + "attn_v_b.weight", {kvl, vd, H}, false, [&e, kv_b, H, nope, vd, kvl] {
    const auto kvb = e.get(kv_b);
    std::vector<float> vb(static_cast<size_t>(H * vd * kvl));
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t j = 0; j < vd; ++j)
        std::copy_n(kvb.begin() + (hh * (nope + vd) + nope + j) * kvl, kvl, vb.begin() + (hh * vd + j) * kvl);
    return vb;
  });
  e.matrix(w, b + "attn_output.weight", h + "self_attn.o_proj.weight");
  if (l < c.first_k_dense_replace || c.n_routed_experts == 0) {
    for (const char* p : {"gate", "up", "down"})
      e.matrix(w, b + fmt::format("ffn_{}.weight", p), h + fmt::format("mlp.{}_proj.weight", p));
    return;
  }
  e.matrix(w, b + "ffn_gate_inp.weight", h + "mlp.gate.weight", true);
  const std::string bias = h + "mlp.gate.e_score_correction_bias";
  e.need(bias, c.n_routed_experts);
  e.add(w, b + "exp_probs_b.bias", {c.n_routed_experts}, true, [&e, bias] { return e.get(bias); });
  const int64_t X = c.n_routed_experts, D = c.hidden_size, F = c.moe_intermediate_size;
  for (const char* p : {"gate", "up", "down"}) {
    // Expert x is slab x (the slowest dimension) of the stack.
    std::vector<std::string> names;
    for (int64_t x = 0; x < X; ++x) {
      names.push_back(h + fmt::format("mlp.experts.{}.{}_proj.weight", x, p));
      e.need(names.back(), D * F);
    }
    const bool down = std::string(p) == "down";
    e.add(w, b + fmt::format("ffn_{}_exps.weight", p),
          down ? std::vector<int64_t>{F, D, X} : std::vector<int64_t>{D, F, X}, false, [&e, names, D, F] {
            std::vector<float> all;
            all.reserve(names.size() * static_cast<size_t>(D * F));
            for (const auto& n : names) {
              const auto one = e.get(n);
              all.insert(all.end(), one.begin(), one.end());
            }
            return all;
          });
  }
  if (c.n_shared_experts > 0)
    for (const char* p : {"gate", "up", "down"})
      e.matrix(w, b + fmt::format("ffn_{}_shexp.weight", p), h + fmt::format("mlp.shared_experts.{}_proj.weight", p));
}

}  // namespace

const std::vector<std::string>& deepseek_v3_pre_splits() {
  static const std::vector<std::string> splits = {
      "\\p{N}{1,3}",
      "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
      "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
  };
  return splits;
}

uint64_t export_gguf(const std::string& hf_dir, const std::string& out, const std::string& type) {
  TensorType t;
  uint32_t file_type;
  if (type == "f32") {
    t = TensorType::F32, file_type = 0;
  } else if (type == "f16") {
    t = TensorType::F16, file_type = 1;
  } else if (type == "bf16") {
    t = TensorType::BF16, file_type = 32;
  } else if (type == "q8_0") {
    t = TensorType::Q8_0, file_type = 7;
  } else if (type == "q4_k") {  // llama.cpp's file types: MOSTLY_Q4_K_S 14, MOSTLY_Q4_K_M 15
    t = TensorType::Q4_K, file_type = 14;
  } else if (type == "q4_k_m") {
    t = TensorType::Q4_K, file_type = 15;
  } else if (type == "q6_k") {  // MOSTLY_Q6_K
    t = TensorType::Q6_K, file_type = 18;
  } else {
    DS_FAIL("gguf export: type '{}' is not f32, f16, bf16, q8_0, q4_k, q4_k_m or q6_k", type);
  }
  const ModelConfig c = load_config(hf_dir);
  DS_CHECK(c.model_type == "deepseek_v3" || c.model_type == "deepseek_v2",
           "gguf export: {} is a {} model; GGUF export writes DeepSeek-V2/V3 models (llama.cpp's deepseek2)", hf_dir,
           c.model_type);
  DS_CHECK(c.index_n_heads == 0 && c.mhc_expansion_rate <= 1 && c.engram_layers.empty(),
           "gguf export: {}: sparse attention, mHC and Engram layers have no deepseek2 tensors in llama.cpp", hf_dir);
  DS_CHECK(c.moe_layer_freq == 1, "gguf export: {}: moe_layer_freq {} (llama.cpp's deepseek2 has every layer after "
                                  "the dense ones routed)",
           hf_dir, c.moe_layer_freq);
  // llama.cpp takes a deepseek2 file of 26 or 27 layers (or 48 with a
  // vocabulary of 128256) for DeepSeek-V2-Lite and reads no q-LoRA there:
  // such a model with q_lora_rank would load with the wrong tensors.
  DS_CHECK(c.q_lora_rank == 0 || !(c.num_hidden_layers == 26 || c.num_hidden_layers == 27 ||
                                   (c.num_hidden_layers == 48 && c.vocab_size == 128256)),
           "gguf export: {}: llama.cpp reads a {}-layer deepseek2 model as DeepSeek-V2-Lite, without q-LoRA, so this "
           "model (q_lora_rank {}) would not load there",
           hf_dir, c.num_hidden_layers, c.q_lora_rank);
  gguf::Writer w;
  write_hparams(w, c, file_type);
  write_tokenizer(w, hf_dir, c);
  Exporter e(hf_dir, t, type);
  e.matrix(w, "token_embd.weight", "model.embed_tokens.weight");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) write_layer(w, e, c, l);
  e.matrix(w, "output_norm.weight", "model.norm.weight", true);
  if (!c.tie_word_embeddings) e.matrix(w, "output.weight", "lm_head.weight");
  return w.write(out);
}

}  // namespace ds::model
