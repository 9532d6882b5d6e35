#include "model/gguf_import.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/system.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/gguf.h"
#include "io/gguf_quants.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/gguf_export.h"
#include "ops/block_quant.h"

namespace ds::model {

namespace {

namespace fs = std::filesystem;
namespace gguf = io::gguf;
using nlohmann::ordered_json;

class File {
 public:
  explicit File(const std::string& path) : path_(path), r_(gguf::Reader::open(path)) {}

  const gguf::Value* find(const std::string& key) const { return r_.find(key); }
  uint64_t u(const std::string& key) const {
    const auto* v = r_.find(key);
    DS_CHECK(v && (v->type == gguf::ValueType::UInt32 || v->type == gguf::ValueType::UInt64),
             "GGUF file '{}': key '{}' is missing or not an unsigned integer", path_, key);
    return std::get<uint64_t>(v->scalar);
  }
  uint64_t u_or(const std::string& key, uint64_t dflt) const { return r_.find(key) ? u(key) : dflt; }
  double f(const std::string& key, double dflt) const {
    const auto* v = r_.find(key);
    if (!v) return dflt;
    DS_CHECK(v->type == gguf::ValueType::Float32 || v->type == gguf::ValueType::Float64,
             "GGUF file '{}': key '{}' is not a float", path_, key);
    return std::get<double>(v->scalar);
  }
  std::string s(const std::string& key) const {
    const auto* v = r_.find(key);
    DS_CHECK(v && v->type == gguf::ValueType::String, "GGUF file '{}': key '{}' is missing or not a string", path_,
             key);
    return std::get<std::string>(v->scalar);
  }
  bool has(const std::string& tensor) const { return r_.tensor(tensor) != nullptr; }
  // A tensor dequantized to float32, checked against its expected ggml shape.
  std::vector<float> get(const std::string& name, const std::vector<int64_t>& ne) const {
    const auto* t = r_.tensor(name);
    DS_CHECK(t, "GGUF file '{}': no tensor '{}'", path_, name);
    DS_CHECK(t->ne == ne, "GGUF file '{}': tensor '{}' has shape [{}], deepseek2 needs [{}]", path_, name,
             fmt::join(t->ne, ", "), fmt::join(ne, ", "));
    DS_CHECK(gguf::can_dequantize(t->type),
             "GGUF file '{}': tensor '{}' is {}, which this engine does not read (it "
             "reads F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)",
             path_, name, gguf::type_name(t->type));
    std::vector<float> out(static_cast<size_t>(t->numel()));
    gguf::dequantize(t->type, r_.data(*t).data(), t->numel(), out.data());
    for (const float x : out)
      DS_CHECK(std::isfinite(x), "GGUF file '{}': tensor '{}' holds a value that is not finite", path_, name);
    return out;
  }
  // The tensor's blocks as they are, when they are a format the engine
  // computes on (Q8_0, Q4_K, Q4_1, Q6_K: ops/block_quant.h) and its rows are
  // whole blocks; null otherwise. Checked against the ggml shape, and every
  // block's f16 scales checked finite.
  const uint8_t* blocks(const std::string& name, const std::vector<int64_t>& ne, DType* format) const {
    const auto* t = r_.tensor(name);
    DS_CHECK(t, "GGUF file '{}': no tensor '{}'", path_, name);
    DS_CHECK(t->ne == ne, "GGUF file '{}': tensor '{}' has shape [{}], deepseek2 needs [{}]", path_, name,
             fmt::join(t->ne, ", "), fmt::join(ne, ", "));
    const DType f = t->type == gguf::TensorType::Q8_0   ? DType::Q8_0
                    : t->type == gguf::TensorType::Q4_K ? DType::Q4_K
                    : t->type == gguf::TensorType::Q4_1 ? DType::Q4_1
                    : t->type == gguf::TensorType::Q6_K ? DType::Q6_K
                                                        : DType::F32;
    if (f == DType::F32 || !ops::fits_block_format(f, ne[0])) return nullptr;
    const uint8_t* p = r_.data(*t).data();
    const int64_t b = ops::blocks_not_finite(f, p, t->numel());
    DS_CHECK(b < 0, "GGUF file '{}': tensor '{}' block {} has a scale that is not finite", path_, name, b);
    *format = f;
    return p;
  }
  // Bytes of `values` values of a tensor's type (whole blocks).
  uint64_t bytes_of(const std::string& name, int64_t values) const {
    const auto bs = gguf::block_size(r_.tensor(name)->type);
    return static_cast<uint64_t>(values / bs.elements * bs.bytes);
  }
  // Values [first, first + n) of a tensor dequantized (n and first whole blocks).
  std::vector<float> get_part(const std::string& name, int64_t first, int64_t n) const {
    const auto* t = r_.tensor(name);
    std::vector<float> out(static_cast<size_t>(n));
    gguf::dequantize(t->type, r_.data(*t).data() + bytes_of(name, first), n, out.data());
    for (const float x : out)
      DS_CHECK(std::isfinite(x), "GGUF file '{}': tensor '{}' holds a value that is not finite", path_, name);
    return out;
  }
  size_t tensor_count() const { return r_.tensors().size(); }
  uint64_t total_values() const {
    uint64_t n = 0;
    for (const auto& t : r_.tensors()) n += static_cast<uint64_t>(t.numel());
    return n;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  gguf::Reader r_;
};

// config.json of the deepseek2 keys (model/gguf_export.h writes them).
ordered_json config_of(const File& f, int64_t vocab) {
  const std::string a = "deepseek2.";
  const int64_t rope = static_cast<int64_t>(f.u(a + "rope.dimension_count"));
  const int64_t key_mla = static_cast<int64_t>(f.u(a + "attention.key_length_mla"));
  DS_CHECK(key_mla > rope, "GGUF file '{}': key_length_mla {} is not above rope.dimension_count {}", f.path(), key_mla,
           rope);
  const int64_t experts = static_cast<int64_t>(f.u_or(a + "expert_count", 0));
  const uint64_t gating = f.u_or(a + "expert_gating_func", 1);
  DS_CHECK(gating == 1 || gating == 2, "GGUF file '{}': expert_gating_func {} (1 softmax and 2 sigmoid are read)",
           f.path(), gating);
  const double scale = f.f(a + "expert_weights_scale", 0.0);
  ordered_json c = {{"architectures", {"DeepseekV3ForCausalLM"}},
                    {"model_type", "deepseek_v3"},
                    {"vocab_size", vocab},
                    {"hidden_size", f.u(a + "embedding_length")},
                    {"intermediate_size", f.u(a + "feed_forward_length")},
                    {"moe_intermediate_size", f.u_or(a + "expert_feed_forward_length", 0)},
                    {"num_hidden_layers", f.u(a + "block_count") - f.u_or(a + "nextn_predict_layers", 0)},
                    {"num_attention_heads", f.u(a + "attention.head_count")},
                    {"num_key_value_heads", f.u(a + "attention.head_count")},
                    {"q_lora_rank", f.find(a + "attention.q_lora_rank") ? ordered_json(f.u(a + "attention.q_lora_rank"))
                                                                        : ordered_json()},
                    {"kv_lora_rank", f.u(a + "attention.kv_lora_rank")},
                    {"qk_rope_head_dim", rope},
                    {"qk_nope_head_dim", key_mla - rope},
                    {"v_head_dim", f.u(a + "attention.value_length_mla")},
                    {"n_routed_experts", experts},
                    {"n_shared_experts", f.u_or(a + "expert_shared_count", 0)},
                    {"num_experts_per_tok", f.u_or(a + "expert_used_count", 0)},
                    {"n_group", f.u_or(a + "expert_group_count", 1)},
                    {"topk_group", f.u_or(a + "expert_group_used_count", 1)},
                    {"routed_scaling_factor", scale == 0.0 ? 1.0 : scale},
                    {"norm_topk_prob",
                     f.find(a + "expert_weights_norm") && std::get<bool>(f.find(a + "expert_weights_norm")->scalar)},
                    {"scoring_func", gating == 2 ? "sigmoid" : "softmax"},
                    {"topk_method", "noaux_tc"},
                    {"first_k_dense_replace", f.u_or(a + "leading_dense_block_count", 0)},
                    {"moe_layer_freq", 1},
                    {"rms_norm_eps", f.f(a + "attention.layer_norm_rms_epsilon", 1e-6)},
                    {"rope_theta", f.f(a + "rope.freq_base", 10000.0)},
                    {"max_position_embeddings", f.u(a + "context_length")},
                    {"tie_word_embeddings", false},
                    {"num_nextn_predict_layers", 0},
                    {"bos_token_id", f.u_or("tokenizer.ggml.bos_token_id", 0)},
                    {"eos_token_id", f.u_or("tokenizer.ggml.eos_token_id", 1)}};
  if (f.find(a + "rope.scaling.type") && f.s(a + "rope.scaling.type") == "yarn") {
    // llama.cpp's yarn_log_multiplier is 0.1 x mscale_all_dim.
    const double mscale = f.f(a + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1;
    c["rope_scaling"] = {{"type", "yarn"},
                         {"factor", f.f(a + "rope.scaling.factor", 1.0)},
                         {"original_max_position_embeddings", f.u(a + "rope.scaling.original_context_length")},
                         {"beta_fast", f.f(a + "rope.scaling.yarn_beta_fast", 32.0)},
                         {"beta_slow", f.f(a + "rope.scaling.yarn_beta_slow", 1.0)},
                         {"mscale", mscale},
                         {"mscale_all_dim", mscale}};
  } else {
    c["rope_scaling"] = nullptr;
  }
  return c;
}

// The pre_tokenizer of a llama.cpp pre-tokenizer name.
ordered_json pre_tokenizer(const std::string& name, const std::string& path) {
  auto split = [](const std::string& re) {
    return ordered_json{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}};
  };
  if (name == "deepseek-v3") {
    ordered_json seq = ordered_json::array();
    for (const auto& re : deepseek_v3_pre_splits()) seq.push_back(split(re));
    seq.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}});
    return {{"type", "Sequence"}, {"pretokenizers", seq}};
  }
  if (name == "gpt-2")
    return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  DS_FAIL("GGUF file '{}': tokenizer.ggml.pre '{}' is not a pre-tokenizer this engine has (deepseek-v3, gpt-2)", path,
          name);
}

// tokenizer.json (and tokenizer_config.json's BOS) from tokenizer.ggml.*.
void write_tokenizer_files(const File& f, const fs::path& out, int64_t* vocab) {
  DS_CHECK(f.s("tokenizer.ggml.model") == "gpt2",
           "GGUF file '{}': tokenizer.ggml.model '{}' (byte-level BPE, gpt2, "
           "is read)",
           f.path(), f.s("tokenizer.ggml.model"));
  const auto* tokens = f.find("tokenizer.ggml.tokens");
  const auto* types = f.find("tokenizer.ggml.token_type");
  const auto* merges = f.find("tokenizer.ggml.merges");
  DS_CHECK(tokens && tokens->array_type == gguf::ValueType::String && types &&
               types->array_type == gguf::ValueType::Int32 && types->array.size() == tokens->array.size() && merges &&
               merges->array_type == gguf::ValueType::String,
           "GGUF file '{}': tokenizer.ggml.tokens, token_type (int32, one per token) and merges are needed", f.path());
  // The BPE vocabulary holds ids 0 .. the last NORMAL token, whatever their
  // type (a trained tokenizer's BOS and EOS sit in it as well as among the
  // added tokens); CONTROL and USER_DEFINED tokens are the added ones.
  size_t normal_end = 0;
  for (size_t i = 0; i < types->array.size(); ++i)
    if (std::get<int64_t>(types->array[i]) == 1) normal_end = i + 1;
  ordered_json vocab_j = ordered_json::object(), added = ordered_json::array();
  for (size_t i = 0; i < tokens->array.size(); ++i) {
    const std::string& text = std::get<std::string>(tokens->array[i]);
    const int64_t type = std::get<int64_t>(types->array[i]);
    if (i < normal_end) {
      DS_CHECK(!vocab_j.contains(text), "GGUF file '{}': token {} ({}) appears twice", f.path(), i, text);
      vocab_j[text] = i;
    }
    if (type == 3 || type == 4) {
      added.push_back({{"id", i},
                       {"content", text},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       // GGUF keeps no flag for it: Hugging Face's default,
                       // special tokens raw, the others normalized.
                       {"normalized", type == 4},
                       {"special", type == 3}});
    }
  }
  ordered_json merges_j = ordered_json::array();
  for (const auto& m : merges->array) merges_j.push_back(std::get<std::string>(m));
  const ordered_json t = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre_tokenizer(f.find("tokenizer.ggml.pre") ? f.s("tokenizer.ggml.pre") : "", f.path())},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab_j},
        {"merges", merges_j}}}};
  io::write_file_atomic((out / "tokenizer.json").string(), t.dump());
  const uint64_t bos = f.u_or("tokenizer.ggml.bos_token_id", 0);
  const bool add_bos =
      f.find("tokenizer.ggml.add_bos_token") && std::get<bool>(f.find("tokenizer.ggml.add_bos_token")->scalar);
  ordered_json tc = {{"add_bos_token", add_bos}, {"add_eos_token", false}};
  if (bos < tokens->array.size()) tc["bos_token"] = std::get<std::string>(tokens->array[bos]);
  io::write_file_atomic((out / "tokenizer_config.json").string(), tc.dump(2) + "\n");
  *vocab = static_cast<int64_t>(tokens->array.size());
}

// One HF tensor of the folder: a quantized file's blocks as they are, or
// float32 values made when it is written (one tensor in memory at a time).
struct Piece {
  std::string name;
  Shape shape;
  DType block = DType::F32;      // the blocks' format, F32: values from make
  const uint8_t* raw = nullptr;  // rows of the blocks
  std::function<std::vector<float>()> make;
};

// The weights under their Hugging Face names.
std::vector<Piece> weights_of(const File& f, const ordered_json& c) {
  const int64_t E = c["hidden_size"], V = c["vocab_size"], H = c["num_attention_heads"], R = c["qk_rope_head_dim"],
                NOPE = c["qk_nope_head_dim"], VD = c["v_head_dim"], KVL = c["kv_lora_rank"], F = c["intermediate_size"],
                FE = c["moe_intermediate_size"], X = c["n_routed_experts"], S = c["n_shared_experts"],
                L = c["num_hidden_layers"], dense = c["first_k_dense_replace"];
  const int64_t QL = c["q_lora_rank"].is_null() ? 0 : c["q_lora_rank"].get<int64_t>();
  std::vector<Piece> out;
  // A ggml (in, out) matrix is the HF [out, in] one, the same bytes.
  auto matrix = [&](const std::string& hf, const std::string& g, int64_t in, int64_t rows) {
    Piece p{hf, {rows, in}, DType::F32, nullptr, {}};
    p.raw = f.blocks(g, {in, rows}, &p.block);
    if (!p.raw) p.make = [&f, g, in, rows] { return f.get(g, {in, rows}); };
    out.push_back(std::move(p));
  };
  auto vec = [&](const std::string& hf, const std::string& g, int64_t n) {
    f.get(g, {n});  // checked now
    out.push_back({hf, {n}, DType::F32, nullptr, [&f, g, n] { return f.get(g, {n}); }});
  };
  matrix("model.embed_tokens.weight", "token_embd.weight", E, V);
  vec("model.norm.weight", "output_norm.weight", E);
  matrix("lm_head.weight", f.has("output.weight") ? "output.weight" : "token_embd.weight", E, V);
  for (int64_t l = 0; l < L; ++l) {
    const std::string b = fmt::format("blk.{}.", l), h = fmt::format("model.layers.{}.", l);
    vec(h + "input_layernorm.weight", b + "attn_norm.weight", E);
    vec(h + "post_attention_layernorm.weight", b + "ffn_norm.weight", E);
    if (QL > 0) {
      matrix(h + "self_attn.q_a_proj.weight", b + "attn_q_a.weight", E, QL);
      vec(h + "self_attn.q_a_layernorm.weight", b + "attn_q_a_norm.weight", QL);
      matrix(h + "self_attn.q_b_proj.weight", b + "attn_q_b.weight", QL, H * (NOPE + R));
    } else {
      matrix(h + "self_attn.q_proj.weight", b + "attn_q.weight", E, H * (NOPE + R));
    }
    matrix(h + "self_attn.kv_a_proj_with_mqa.weight", b + "attn_kv_a_mqa.weight", E, KVL + R);
    vec(h + "self_attn.kv_a_layernorm.weight", b + "attn_kv_a_norm.weight", KVL);
    if (f.has(b + "attn_kv_b.weight")) {
      matrix(h + "self_attn.kv_b_proj.weight", b + "attn_kv_b.weight", KVL, H * (NOPE + VD));
    } else {
      // kv_b_proj [H (nope + v), kvl] from attn_k_b (nope, kvl, H) and attn_v_b (kvl, v, H).
      const std::string kn = b + "attn_k_b.weight", vn = b + "attn_v_b.weight";
      f.get(kn, {NOPE, KVL, H}), f.get(vn, {KVL, VD, H});  // checked now
      out.push_back({h + "self_attn.kv_b_proj.weight",
                     {H * (NOPE + VD), KVL},
                     DType::F32,
                     nullptr,
                     [&f, kn, vn, H, NOPE, VD, KVL] {
                       const auto kb = f.get(kn, {NOPE, KVL, H}), vb = f.get(vn, {KVL, VD, H});
                       std::vector<float> kv(static_cast<size_t>(H * (NOPE + VD) * KVL));
                       for (int64_t hh = 0; hh < H; ++hh)
                         for (int64_t col = 0; col < KVL; ++col) {
                           for (int64_t d = 0; d < NOPE; ++d)
                             kv[static_cast<size_t>((hh * (NOPE + VD) + d) * KVL + col)] =
                                 kb[static_cast<size_t>((hh * KVL + col) * NOPE + d)];
                           for (int64_t j = 0; j < VD; ++j)
                             kv[static_cast<size_t>((hh * (NOPE + VD) + NOPE + j) * KVL + col)] =
                                 vb[static_cast<size_t>((hh * VD + j) * KVL + col)];
                         }
                       return kv;
                     }});
    }
    matrix(h + "self_attn.o_proj.weight", b + "attn_output.weight", H * VD, E);
    if (l < dense || X == 0) {
      matrix(h + "mlp.gate_proj.weight", b + "ffn_gate.weight", E, F);
      matrix(h + "mlp.up_proj.weight", b + "ffn_up.weight", E, F);
      matrix(h + "mlp.down_proj.weight", b + "ffn_down.weight", F, E);
      continue;
    }
    matrix(h + "mlp.gate.weight", b + "ffn_gate_inp.weight", E, X);
    const std::string bias = b + "exp_probs_b.bias";
    if (f.has(bias)) f.get(bias, {X});
    out.push_back({h + "mlp.gate.e_score_correction_bias", {X}, DType::F32, nullptr, [&f, bias, X] {
                     return f.has(bias) ? f.get(bias, {X}) : std::vector<float>(static_cast<size_t>(X), 0.0f);
                   }});
    for (const char* p : {"gate", "up", "down"}) {
      const bool down = std::string(p) == "down";
      const int64_t in = down ? FE : E, rows = down ? E : FE;
      const std::string g = b + fmt::format("ffn_{}_exps.weight", p);
      DType block = DType::F32;
      const uint8_t* raw = f.blocks(g, {in, rows, X}, &block);
      // Expert x is slab x of the stack: its rows, whole blocks.
      for (int64_t x = 0; x < X; ++x) {
        Piece e{h + fmt::format("mlp.experts.{}.{}_proj.weight", x, p), {rows, in}, block, nullptr, {}};
        if (raw)
          e.raw = raw + f.bytes_of(g, x * in * rows);
        else
          e.make = [&f, g, x, in, rows] { return f.get_part(g, x * in * rows, in * rows); };
        out.push_back(std::move(e));
      }
    }
    if (S > 0) {
      matrix(h + "mlp.shared_experts.gate_proj.weight", b + "ffn_gate_shexp.weight", E, FE * S);
      matrix(h + "mlp.shared_experts.up_proj.weight", b + "ffn_up_shexp.weight", E, FE * S);
      matrix(h + "mlp.shared_experts.down_proj.weight", b + "ffn_down_shexp.weight", FE * S, E);
    }
  }
  return out;
}

}  // namespace

bool is_gguf_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && std::string(magic, 4) == "GGUF";
}

void import_gguf(const std::string& gguf_path, const std::string& out_dir) {
  const File f(gguf_path);
  const std::string arch = f.s("general.architecture");
  DS_CHECK(arch == "deepseek2",
           "GGUF file '{}' is a '{}' model; this engine reads DeepSeek-V2/V3 files (llama.cpp's "
           "deepseek2)",
           gguf_path, arch);
  io::check_output_folder(out_dir);
  const fs::path out(out_dir);
  fs::create_directories(out);
  int64_t vocab = 0;
  write_tokenizer_files(f, out, &vocab);
  const ordered_json c = config_of(f, vocab);
  // The config's own checks (sizes within bounds, a consistent MLA and
  // MoE) before any tensor is read or any buffer sized from it.
  try {
    ModelConfig::from_hf_json_text(c.dump(), gguf_path);
  } catch (const Error& e) {
    DS_FAIL("GGUF file '{}': its deepseek2 keys make no model: {}", gguf_path, e.what());
  }
  // Blocks the engine computes on are kept (U8 rows, as `deepseek
  // quantize` writes them); other tensors become float32, one at a time.
  const std::vector<Piece> pieces = weights_of(f, c);
  std::vector<io::SafetensorsWriter::Entry> entries;
  bool blocks = false;
  int64_t largest = 0;
  for (const auto& p : pieces) {
    if (p.raw) {
      const int64_t row = ops::block_row_bytes(p.block, p.shape[1]);
      entries.push_back({p.name, "U8", {p.shape[0], row}, static_cast<uint64_t>(p.shape[0] * row)});
      blocks = true;
    } else {
      entries.push_back({p.name, "F32", p.shape, static_cast<uint64_t>(shape_numel(p.shape)) * 4});
      largest = std::max(largest, shape_numel(p.shape));
    }
  }
  check_fits_in_memory(largest * 8, "the GGUF file's largest tensor in float32");
  io::SafetensorsWriter w((out / "model.safetensors").string(), entries, {{"format", "pt"}, {"source", "gguf"}});
  for (const auto& p : pieces) {
    if (p.raw) {
      w.write(p.raw, entries[static_cast<size_t>(&p - pieces.data())].bytes);
      continue;
    }
    const std::vector<float> v = p.make();
    w.write(v.data(), v.size() * sizeof(float));
  }
  w.commit();
  ordered_json config = c;
  if (blocks)
    config["quantization_config"] = {{"quant_method", "deepseek_cpp"}, {"format_version", 1}, {"source", "gguf"}};
  io::write_file_atomic((out / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace ds::model
