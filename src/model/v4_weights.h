// A DeepSeek-V4 checkpoint's weights, found by the upstream tensor names
// (model_type deepseek_v4) and kept in their stored dtype: fp8 e4m3 with
// 128x128 block scales (E8M0 on the instruct releases, float32 on -Base,
// read as float32), routed experts as packed fp4 (two e2m1 codes a byte, an
// E8M0 scale per 32) or fp8, bf16 elsewhere. Nothing large is widened; small
// vectors (norms, biases, sinks, the mHC mixes, position embeddings) are
// float32 copies, and tid2eid an int32 copy.
//
// Accepted spellings, as DeepSeek's own converter accepts them: a leading
// "model.", "weight_scale_inv" for "scale", "e_score_correction_bias" for
// "gate.bias"; tid2eid as I64 or I32. Hugging Face's names (a folder saved
// by its DeepseekV4 classes) are read too, with its fused routed experts
// (mlp.experts.gate_up_proj [E, 2I, d], down_proj [E, d, I]) in a float
// dtype. The config's MTP layers ("mtp.k.*") are loaded like the others;
// their copies of the embedding and head are skipped, and a folder without
// them (Hugging Face's classes do not save MTP) is read with a config whose
// num_nextn_predict_layers is v4_stored_mtp_layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/v4_params.h"
#include "ops/linear.h"

namespace ds::model {

// Hugging Face's name for an upstream tensor name (weights, scales, tables;
// "" for none, e.g. a routed expert, which it fuses).
std::string v4_hf_name(const std::string& upstream);

// How many of the config's MTP layers the checkpoint holds (the first k).
int64_t v4_stored_mtp_layers(const io::SafetensorsSet& st, const V4Config& cfg);

struct V4Weight {
  std::vector<float> f32;     // vectors, and matrices widened at load (see V4Weights::load)
  std::vector<float> scale;   // fp8 block scales as float32
  std::vector<int32_t> ints;  // tid2eid
  ops::WeightView view;       // what the forward reads (tid2eid: I32 [V, k])
};

using V4View = V4Params<ops::WeightView>;
using V4LayerView = V4LayerParams<ops::WeightView>;

struct V4Weights {
  V4Params<V4Weight> tensors;
  V4View view;
  size_t weight_bytes = 0;  // bytes of the checkpoint tensors in use

  V4Weights() = default;
  V4Weights(V4Weights&&) = default;
  V4Weights& operator=(V4Weights&&) = default;
  V4Weights(const V4Weights&) = delete;
  V4Weights& operator=(const V4Weights&) = delete;

  // Checks every tensor's presence, shape, dtype and (floats) finiteness,
  // every tid2eid entry against the expert count, and that the checkpoint
  // holds nothing else. wo_a stays fp8 when its groups start on scale-block
  // rows (every released model); a toy model whose o_lora_rank is not a
  // multiple of the block rows gets it widened to float32.
  static V4Weights load(const io::SafetensorsSet& st, const V4Config& cfg);
};

}  // namespace ds::model
