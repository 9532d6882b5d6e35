// DeepSeek-V4.1's configuration (V4Config with generation V41): the
// released config.json (model_type deepseek_v41, the text model's keys in
// text_config; quantization_config, the token ids and image_token_id at the
// root) and the official inference code's flat ModelArgs names
// (inference/config.json), the CSA2 layer roles, and the Engram keys.
#include <algorithm>
#include <map>

#include "core/error.h"
#include "io/token_classes.h"
#include "io/tokenizer.h"
#include "model/engram_hash.h"
#include "model/json_fields.h"
#include "model/v4_config.h"

namespace ds::model {

namespace {

using namespace json_fields;

constexpr int64_t kEngramLayers = 64, kEngramColumns = 512, kEngramRows = int64_t{1} << 40;

// The official flat names -> the released text_config's.
const std::map<std::string, std::string>& flat_names() {
  static const std::map<std::string, std::string> m = {
      {"dim", "hidden_size"},
      {"n_layers", "num_hidden_layers"},
      {"n_mtp_layers", "num_nextn_predict_layers"},
      {"n_heads", "num_attention_heads"},
      {"rope_head_dim", "qk_rope_head_dim"},
      {"window_size", "sliding_window"},
      {"kv_source_layers", "kv_source_layer_ids"},
      {"index_source_layers", "index_source_layer_ids"},
      {"candidate_source_layer", "candidate_source_layer_id"},
      {"n_activated_experts", "num_experts_per_tok"},
      {"moe_inter_dim", "moe_intermediate_size"},
      {"score_func", "scoring_func"},
      {"route_scale", "routed_scaling_factor"},
      {"norm_eps", "rms_norm_eps"},
      {"engram_pad_id", "engram_pad_token_id"},
      {"engram_n_embed_per_ngram", ""},  // derived from the primes; unused
  };
  return m;
}

// The flat file as the released text_config (YaRN fields gathered).
json from_flat(const json& f) {
  json t = json::object();
  for (auto& [k, v] : f.items()) {
    auto it = flat_names().find(k);
    if (it == flat_names().end())
      t[k] = v;
    else if (!it->second.empty())
      t[it->second] = v;
  }
  if (f.contains("rope_factor") && f.contains("original_seq_len")) {
    t["rope_scaling"] = {
        {"type", "yarn"}, {"factor", f["rope_factor"]}, {"original_max_position_embeddings", f["original_seq_len"]}};
    if (f.contains("beta_fast")) t["rope_scaling"]["beta_fast"] = f["beta_fast"];
    if (f.contains("beta_slow")) t["rope_scaling"]["beta_slow"] = f["beta_slow"];
  }
  if (!t.contains("vocab_size") && f.contains("vocab_size")) t["vocab_size"] = f["vocab_size"];
  return t;
}

std::vector<int64_t> ints(const json& t, const char* key, const std::string& src) {
  if (!t.contains(key) || t[key].is_null()) return {};
  DS_CHECK(t[key].is_array() && t[key].size() <= static_cast<size_t>(1 << 12),
           "{}: key '{}' must be an array of integers", src, key);
  std::vector<int64_t> out;
  for (const json& e : t[key]) out.push_back(strict_int(e, key, src));
  return out;
}

bool contains(const std::vector<int64_t>& v, int64_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// The last entry of a sorted list that is <= l (-1: none).
int64_t last_at_or_before(const std::vector<int64_t>& v, int64_t l) {
  int64_t best = -1;
  for (int64_t x : v)
    if (x <= l) best = std::max(best, x);
  return best;
}

}  // namespace

bool v41_flat_config(const json& j) {
  return j.is_object() && !j.contains("model_type") && j.contains("dim") && j.contains("n_layers") &&
         (j.contains("engram_layer_ids") || j.contains("kv_source_layers"));
}

V4Config V4Config::from_v41_json(const json& root, const std::string& src) {
  const bool flat = v41_flat_config(root);
  json t;
  if (flat) {
    t = from_flat(root);
  } else {
    DS_CHECK(root.contains("text_config") && root["text_config"].is_object(),
             "{}: a deepseek_v41 config.json needs the text model's keys in 'text_config'", src);
    t = root["text_config"];
    // The root's fields the text model needs, unless text_config has its own.
    for (const char* k : {"bos_token_id", "eos_token_id", "image_token_id", "quantization_config", "vocab_size"})
      if (root.contains(k) && !t.contains(k)) t[k] = root[k];
  }
  // The keys both releases share through V4's reader (V4.1 has no hash
  // layers; its routed experts' dtype sits in quantization_config).
  json v4 = t;
  v4.erase("num_hash_layers");
  if (!v4.contains("hc_sinkhorn_iters")) v4["hc_sinkhorn_iters"] = 20;
  if (!v4.contains("hc_eps")) v4["hc_eps"] = 1e-6;
  const bool quantized = v4.contains("quantization_config") && v4["quantization_config"].is_object();
  if (quantized) {
    json& q = v4["quantization_config"];
    if (q.contains("expert_dtype") && !v4.contains("expert_dtype")) v4["expert_dtype"] = q["expert_dtype"];
  }
  V4Config c = read_hf_fields(v4, src);
  if (!quantized) c.fp8_block_rows = c.fp8_block_cols = 32;  // the official flat file names no blocks: V4.1's
  c.generation = V4Generation::V41;
  c.num_nextn_predict_layers = 0;  // DSpark's draft stages (mtp.*) are not part of the text model
  c.kv_source_layers = ints(t, "kv_source_layer_ids", src);
  c.index_source_layers = ints(t, "index_source_layer_ids", src);
  c.candidate_source_layer = get_or<int64_t>(t, "candidate_source_layer_id", -1, src);
  c.candidate_topk_blocks = get_or<int64_t>(t, "candidate_topk_blocks", 0, src);
  c.candidate_block_size = get_or<int64_t>(t, "candidate_block_size", 0, src);
  c.engram_layers = ints(t, "engram_layer_ids", src);
  c.engram_num_embeddings = ints(t, "engram_num_embeddings", src);
  c.engram_max_ngram_size = get_or<int64_t>(t, "engram_max_ngram_size", 0, src);
  c.engram_heads = get_or<int64_t>(t, "engram_n_heads", 0, src);
  c.engram_head_dim = get_or<int64_t>(t, "engram_head_dim", 0, src);
  c.engram_vocab_base = get_or<int64_t>(t, "engram_vocab_size", 0, src);
  c.engram_pad_id = get_or<int64_t>(t, "engram_pad_token_id", get_or<int64_t>(t, "engram_pad_id", 2, src), src);
  c.engram_compressed_vocab = get_or<int64_t>(t, "engram_compressed_vocab_size", 0, src);
  c.image_token_id = get_or<int64_t>(t, "image_token_id", -1, src);
  return validated(std::move(c), src);
}

bool V4Config::owns_compressor(int64_t l) const {
  return v41() ? contains(kv_source_layers, l) : compress_ratio(l) > 0;
}

bool V4Config::owns_indexer(int64_t l) const {
  return v41() ? contains(index_source_layers, l) : compress_ratio(l) == 4;
}

int64_t V4Config::kv_source_of(int64_t l) const { return v41() ? last_at_or_before(kv_source_layers, l) : l; }

int64_t V4Config::index_source_of(int64_t l) const { return v41() ? last_at_or_before(index_source_layers, l) : l; }

int64_t V4Config::engram_slot(int64_t l) const {
  for (size_t i = 0; i < engram_layers.size(); ++i)
    if (engram_layers[i] == l) return static_cast<int64_t>(i);
  return -1;
}

void V4Config::validate_v41() const {
  const int64_t L = num_hidden_layers;
  DS_CHECK(num_hash_layers == 0, "config: DeepSeek-V4.1 has no hash-routed layers");
  DS_CHECK(num_nextn_predict_layers == 0, "internal: DeepSeek-V4.1's draft stages are not loaded");
  auto sorted_layers = [&](const std::vector<int64_t>& v, const char* key) {
    for (size_t i = 0; i < v.size(); ++i) {
      DS_CHECK(v[i] >= 0 && v[i] < L, "config: {} holds layer {}, outside [0, {})", key, v[i], L);
      DS_CHECK(i == 0 || v[i] > v[i - 1], "config: {} must be strictly increasing", key);
    }
  };
  sorted_layers(kv_source_layers, "kv_source_layer_ids");
  sorted_layers(index_source_layers, "index_source_layer_ids");
  sorted_layers(engram_layers, "engram_layer_ids");
  for (int64_t l : kv_source_layers)
    DS_CHECK(compress_ratio(l) > 0, "config: KV source layer {} has compress ratio 0", l);
  for (int64_t l : index_source_layers) {
    DS_CHECK(compress_ratio(l) > 0, "config: index source layer {} has compress ratio 0", l);
    const int64_t k = kv_source_of(l);
    DS_CHECK(k >= 0, "config: index source layer {} has no KV source layer at or before it", l);
    DS_CHECK(k == l || index_source_of(k) == k,
             "config: index source layer {} scores layer {}'s keys, which is not an index source itself", l, k);
  }
  if (!index_source_layers.empty())
    DS_CHECK(owns_compressor(index_source_layers.front()),
             "config: the first index source layer {} must be a KV source layer", index_source_layers.front());
  for (int64_t l = 0; l < L; ++l) {
    const int64_t m = compress_ratio(l);
    if (m == 0) continue;
    const int64_t k = kv_source_of(l), i = index_source_of(l);
    DS_CHECK(k >= 0, "config: layer {} (compress ratio {}) has no KV source layer at or before it", l, m);
    DS_CHECK(compress_ratio(k) == m, "config: layer {} has compress ratio {}, its KV source layer {} has {}", l, m, k,
             compress_ratio(k));
    DS_CHECK(i >= 0, "config: layer {} (compress ratio {}) has no index source layer at or before it", l, m);
    DS_CHECK(kv_source_of(i) == k,
             "config: layer {} reads layer {}'s entries but layer {}'s top-k, chosen over layer {}'s", l, k, i,
             kv_source_of(i));
  }
  if (candidate_source_layer >= 0) {
    DS_CHECK(owns_indexer(candidate_source_layer), "config: candidate_source_layer_id {} is not an index source layer",
             candidate_source_layer);
    DS_CHECK(candidate_topk_blocks >= 1 && candidate_topk_blocks <= (int64_t{1} << 26) && candidate_block_size >= 1 &&
                 candidate_block_size <= (int64_t{1} << 16),
             "config: candidate_topk_blocks {} and candidate_block_size {} must be positive", candidate_topk_blocks,
             candidate_block_size);
  } else {
    DS_CHECK(candidate_source_layer == -1, "config: candidate_source_layer_id {} (negative: none)",
             candidate_source_layer);
  }
  if (head_dim % 16 != 0) DS_FAIL("config: head_dim {} must be a multiple of 16 (the entries' fp4 groups)", head_dim);
  if (engram_layers.empty()) return;
  const int64_t E = static_cast<int64_t>(engram_layers.size());
  DS_CHECK(E <= kEngramLayers, "config: {} Engram layers (at most {})", E, kEngramLayers);
  DS_CHECK(static_cast<int64_t>(engram_num_embeddings.size()) == E,
           "config: engram_num_embeddings has {} entries for {} Engram layers", engram_num_embeddings.size(), E);
  DS_CHECK(engram_max_ngram_size >= 2 && engram_max_ngram_size <= 8, "config: engram_max_ngram_size {} (2 .. 8)",
           engram_max_ngram_size);
  DS_CHECK(engram_heads >= 1 && engram_columns() <= kEngramColumns, "config: engram_n_heads {} (1 .. {} columns)",
           engram_heads, kEngramColumns);
  DS_CHECK(engram_head_dim >= 1 && engram_head_dim <= (1 << 14), "config: engram_head_dim {} (1 .. 16384)",
           engram_head_dim);
  DS_CHECK(engram_vocab_base >= 2 && engram_vocab_base <= (int64_t{1} << 40),
           "config: engram_vocab_size {} (2 .. 2^40)", engram_vocab_base);
  DS_CHECK(engram_compressed_vocab >= 1 && engram_compressed_vocab <= vocab_size,
           "config: engram_compressed_vocab_size {} must be in [1, vocab_size {}]", engram_compressed_vocab,
           vocab_size);
  DS_CHECK(engram_pad_id >= 0 && engram_pad_id < vocab_size, "config: engram_pad_token_id {} is outside the vocabulary",
           engram_pad_id);
  for (int64_t r : engram_num_embeddings)
    DS_CHECK(r >= 1 && r <= kEngramRows, "config: engram_num_embeddings entry {} (1 .. 2^40)", r);
  // The primes' search must stay small: rows of a table are at least the
  // columns times the base.
  DS_CHECK(engram_vocab_base <= kEngramRows / engram_columns() / E, "config: engram_vocab_size {} is too large",
           engram_vocab_base);
}

EngramHashSpec V4Config::engram_hash_spec() const {
  EngramHashSpec s;
  s.layers = engram_layers;
  s.max_ngram = engram_max_ngram_size;
  s.heads = engram_heads;
  s.vocab_bases.assign(static_cast<size_t>(engram_max_ngram_size - 1), engram_vocab_base);
  s.seed = 0;
  s.compressed_vocab = engram_compressed_vocab;
  s.scheme = EngramHashScheme::Int64;
  return s;
}

void V4Config::attach_engram_classes(const std::string& tokenizer_json) {
  if (engram_layers.empty()) return;
  const io::Tokenizer tok = io::Tokenizer::from_file(tokenizer_json);
  io::TokenClasses tc = io::engram_token_classes(tok, vocab_size);
  DS_CHECK(tc.count == engram_compressed_vocab,
           "{}: the tokenizer's Engram token classes number {}, config.json's engram_compressed_vocab_size says {} "
           "(another tokenizer?)",
           tokenizer_json, tc.count, engram_compressed_vocab);
  engram_token_classes = std::make_shared<const std::vector<int32_t>>(std::move(tc.table));
}

json V4Config::to_v41_json() const {
  V4Config base = *this;
  base.generation = V4Generation::V4;
  json t = base.to_hf_json();
  t["model_type"] = "deepseek_v41_text";
  t["head_dim"] = head_dim;
  t.erase("num_hash_layers");
  t.erase("architectures");
  t["kv_source_layer_ids"] = kv_source_layers;
  t["index_source_layer_ids"] = index_source_layers;
  t["candidate_source_layer_id"] = candidate_source_layer;
  t["candidate_topk_blocks"] = candidate_topk_blocks;
  t["candidate_block_size"] = candidate_block_size;
  if (!engram_layers.empty()) {
    t["engram_layer_ids"] = engram_layers;
    t["engram_num_embeddings"] = engram_num_embeddings;
    t["engram_max_ngram_size"] = engram_max_ngram_size;
    t["engram_n_heads"] = engram_heads;
    t["engram_head_dim"] = engram_head_dim;
    t["engram_vocab_size"] = engram_vocab_base;
    t["engram_pad_token_id"] = engram_pad_id;
    t["engram_compressed_vocab_size"] = engram_compressed_vocab;
  }
  json root = {{"architectures", {"DeepseekV41ForCausalLM"}},
               {"model_type", "deepseek_v41"},
               {"bos_token_id", bos_token_id},
               {"eos_token_id", eos_token_id},
               {"text_config", t}};
  if (image_token_id >= 0) root["image_token_id"] = image_token_id;
  return root;
}

}  // namespace ds::model
