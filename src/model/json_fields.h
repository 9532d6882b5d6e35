// Typed, strict access to the fields of a Hugging Face config.json, shared
// by the config readers: a wrong type or an out-of-range integer is one
// error line naming the file and the key, never a silent conversion.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/config.h"

namespace ds::model::json_fields {

using json = nlohmann::json;

// A JSON value shortened for an error line: a crafted file can hold a
// number or string of any length.
inline std::string brief(const json& v) {
  std::string s = v.dump();
  if (s.size() > 48) s = s.substr(0, 40) + "...(" + std::to_string(s.size()) + " characters)";
  return s;
}

// A JSON integer in int64_t: 64.9, 64.0, "64" and 2^63 are all errors
// (nlohmann would truncate the first two and wrap the last).
inline int64_t strict_int(const json& v, const char* key, const std::string& src) {
  DS_CHECK(v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{INT64_MAX}),
           "{}: key '{}' must be an integer, got {}", src, key, brief(v));
  return v.get<int64_t>();
}

// The text as a JSON object, or one error line naming `src`.
inline json parse_object(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DS_FAIL("{} is not valid JSON: {}", src, e.what());
  }
  DS_CHECK(j.is_object(), "{} must be a JSON object", src);
  return j;
}

// Typed access to a config.json field, naming the key on a type mismatch.
template <typename T>
T get(const json& j, const char* key, const std::string& src) {
  DS_CHECK(j.contains(key), "{}: key '{}' is missing", src, key);
  const json& v = j.at(key);
  if constexpr (std::is_same_v<T, int64_t>) {
    return strict_int(v, key, src);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    DS_CHECK(v.is_array() && v.size() <= 16, "{}: key '{}' must be a short array of integers, got {}", src, key,
             brief(v));
    std::vector<int64_t> out;
    for (const json& e : v) out.push_back(strict_int(e, key, src));
    return out;
  } else {
    try {
      return v.get<T>();
    } catch (const json::exception&) {
      DS_FAIL("{}: key '{}' has the wrong type (got {})", src, key, brief(v));
    }
  }
}
template <typename T>
T get_or(const json& j, const char* key, T fallback, const std::string& src) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return get<T>(j, key, src);
}

// rope_scaling: null or absent (plain RoPE) or YaRN ("type" or "rope_type").
inline YarnScaling read_rope_scaling(const json& j, const std::string& src) {
  YarnScaling y;
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return y;
  const json& r = j["rope_scaling"];
  DS_CHECK(r.is_object(), "{}: rope_scaling must be an object or null", src);
  const std::string type =
      r.contains("type") ? get<std::string>(r, "type", src) : get_or<std::string>(r, "rope_type", "", src);
  DS_CHECK(type == "yarn", "{}: rope_scaling type '{}' is not supported (yarn)", src, type);
  y.enabled = true;
  y.factor = get<double>(r, "factor", src);
  y.original_max_position_embeddings = get<int64_t>(r, "original_max_position_embeddings", src);
  y.beta_fast = get_or<double>(r, "beta_fast", 32.0, src);
  y.beta_slow = get_or<double>(r, "beta_slow", 1.0, src);
  y.mscale = get_or<double>(r, "mscale", 1.0, src);
  y.mscale_all_dim = get_or<double>(r, "mscale_all_dim", 0.0, src);
  return y;
}

// quantization_config (an object): fp8 e4m3 ("fmt" defaults to e4m3) with
// block scales of weight_block_size [rows, cols] (default 128 x 128).
inline std::pair<int64_t, int64_t> read_fp8_quantization(const json& q, const std::string& method,
                                                         const std::string& src) {
  const std::string fmt = get_or<std::string>(q, "fmt", "e4m3", src);
  DS_CHECK(method == "fp8" && fmt == "e4m3", "{}: quantization '{}' ({}) is not supported (fp8 e4m3)", src, method,
           fmt);
  auto block = get_or<std::vector<int64_t>>(q, "weight_block_size", {128, 128}, src);
  DS_CHECK(block.size() == 2 && block[0] > 0 && block[1] > 0, "{}: weight_block_size must be [rows, cols]", src);
  return {block[0], block[1]};
}

// quantization_config with quant_method `method`: a `deepseek quantize`
// folder (deepseek_cpp, format_version 1) gives true; otherwise the fp8
// blocks (read_fp8_quantization) go to rows and cols and it gives false.
inline bool read_quantization(const json& q, const std::string& method, const std::string& src, int64_t& rows,
                              int64_t& cols) {
  if (method == "deepseek_cpp") {
    const int64_t version = get_or<int64_t>(q, "format_version", 0, src);
    DS_CHECK(version == 1, "{}: quantization_config format_version {} is not one this build reads (1)", src, version);
    return true;
  }
  std::tie(rows, cols) = read_fp8_quantization(q, method, src);
  return false;
}

// c.validate(), its error prefixed with the file's name.
template <class Config>
Config validated(Config c, const std::string& src) {
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", src, e.what()));
  }
  return c;
}

}  // namespace ds::model::json_fields
