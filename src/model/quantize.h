// `deepseek quantize`: a DeepSeek-V2/V3/V3.2 (mHC and Engram included), V4
// or V4.1 model folder with its matrices stored as q8_0 or q4_k blocks
// (ops/block_quant.h), which every command loads (model/weights.h,
// model/v4_weights.h) and runs on the block kernels (ops/linear.h). V4 and
// V4.1 folders are written under DeepSeek's upstream tensor names,
// config.json without expert_dtype (V4.1: the root's quantization_config
// only); V4.1's Engram tables are copied byte for byte.
//
// The folder is the input's with model.safetensors rewritten (one file,
// written a tensor at a time) and config.json's quantization_config saying
// how:
//   {"quant_method": "deepseek_cpp", "format_version": 1, "recipe": "q4_k_m",
//    "formats": {"q8_0": ..., "q4_k": ...}, "tensors": {"q4_k": N, ...}}
// A block-quantized matrix [out, in] is a U8 tensor [out, bytes a row]:
// in / 32 * 34 bytes for q8_0, in / 256 * 144 for q4_k, in / 32 * 20 for
// q4_1 (no two coincide), so each tensor says its own format. Everything else keeps the
// input's dtype (fp8 matrices become bf16: their block scales have no place
// beside the blocks).
//
// Recipes, as llama.cpp's types:
//   q8_0    every projection, the embedding and the LM head in q8_0;
//   q4_k    every projection and the embedding in q4_k, the LM head q8_0;
//   q4_k_m  the routed experts (most of a MoE's bytes) in q4_k; attention,
//           the shared experts, dense MLPs, the MTP projection, the
//           embedding and the LM head in q8_0.
// Norms, the router, its bias, V4's hash table, the mHC mixes, the Engram
// tables and conv kernels, and the indexers' matrices (V3.2's, V4's) stay as
// they are (fp8 matrices as bf16), and so does anything that is not a
// matrix. Overrides (`REGEX=FORMAT`, the first whose regex matches the whole
// tensor name wins, before the recipe) set any matrix to q4_k, q8_0, q4_1,
// bf16 or f32. A matrix whose rows are not whole blocks falls back (each
// fallback is reported): q4_k to q4_1 (4-bit codes with a scale and an
// offset per 32 values, 5 bits a weight; llama.cpp falls back to its 5.5-bit
// Q5_0 there), q4_1 and q8_0 to bf16 (rows that are not whole blocks of 32).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ds::model {

struct QuantizeOptions {
  std::string recipe = "q4_k_m";                               // q8_0, q4_k, q4_k_m
  std::vector<std::pair<std::string, std::string>> overrides;  // (regex, format)
};

struct QuantizeReport {
  std::map<std::string, int64_t> tensors;    // format -> tensors written in it
  std::map<std::string, uint64_t> bytes;     // format -> their bytes
  std::map<std::string, int64_t> fallbacks;  // "q4_k -> q4_1 (384 columns)" -> tensors
  uint64_t bytes_in = 0, bytes_out = 0;      // the weights read and written
};

// Reads the folder `in`, writes the folder `out` (new, or empty).
QuantizeReport quantize_model(const std::string& in, const std::string& out, const QuantizeOptions& opt);

// "REGEX=FORMAT" as an override (ds::Error for a bad regex or format).
std::pair<std::string, std::string> parse_quantize_override(const std::string& text);

}  // namespace ds::model
