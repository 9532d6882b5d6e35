// A model's float32 parameters (laid out as FlatParams or V4FlatParams)
// from and to Hugging Face folders, and their random initialisation.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "model/config.h"
#include "model/model.h"
#include "model/v4_train.h"

namespace ds::model {

// Parameters from a Hugging Face folder (any float dtype, fp8 with block
// scales), converted to float32; MTP layers from model.layers.{L + k}.
void load_hf_params(const std::string& dir, const ModelConfig& cfg, int64_t mtp_layers, FlatParams& params);
// A Hugging Face folder from float32 parameters: config.json, model.safetensors
// in `dtype` (F32, BF16 or F16; norms and the routing bias stay float32), and
// for each MTP layer the embed_tokens / shared_head.head copies Hugging Face's
// layout carries.
void export_hf(const std::string& out_dir, const ModelConfig& cfg, int64_t mtp_layers, const FlatParams& params,
               DType dtype);

// Random initialisation: matrices normal(0, std) (one Philox stream per
// tensor, in tree order, as `deepseek init` does), norms 1, routing bias 0.
void init_params(const ModelConfig& cfg, int64_t mtp_layers, FlatParams& params, uint64_t seed, float std);

// DeepSeek-V4, in the layout of V4FlatParams (tables synced after
// each). Random initialisation: matrices normal(0, std) (one Philox stream
// per tensor in tree order), norm and mHC scales 1, the sinks and the mHC
// and routing biases 0, and each token's hash-routed experts distinct draws.
void init_v4_params(const V4Config& c, V4FlatParams& p, uint64_t seed, float std);
// Parameters of a V4 folder (any stored dtype: fp8, packed fp4, bf16),
// checked as generation checks them and widened to float32.
void load_v4_hf_params(const std::string& dir, const V4Config& c, V4FlatParams& p);
// A V4 folder from float32 parameters: upstream tensor names in `dtype`
// (vectors float32, tid2eid int32) and config.json; `deepseek generate` reads it.
// `who` prefixes its errors.
void export_v4_hf(const std::string& out_dir, const V4Config& c, const float* params, DType dtype,
                  const char* who = "export");

}  // namespace ds::model
