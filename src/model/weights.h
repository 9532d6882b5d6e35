// The weights of a DeepSeek model, found by their Hugging Face names and kept
// in the checkpoint's own dtype (mmapped; fp8 with its block scales). Only the
// small vectors (norm weights, routing bias) are widened to float32 here.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "ops/linear.h"

namespace ds::model {

// A Linear layer's weight [out, in] and, for fp8, its scale_inv; the tensors
// keep the mapping alive.
struct Linear {
  Tensor weight, scale_inv;
  ops::WeightView view;
  int64_t out() const { return view.rows; }
  int64_t in() const { return view.cols; }
};

struct Mlp {  // down(silu(gate(x)) * up(x))
  Linear gate, up, down;
};

struct Attention {
  Linear q_a, q_b, q;  // q_a/q_b with q-LoRA, q without
  std::vector<float> q_a_norm;
  Linear kv_a;  // [kv_lora_rank + qk_rope_head_dim, hidden]
  std::vector<float> kv_a_norm;
  Linear kv_b;  // [heads * (qk_nope + v), kv_lora_rank]
  Linear o;     // [hidden, heads * v]
};

struct Moe {
  Linear gate;               // router [n_routed_experts, hidden]
  std::vector<float> bias;   // e_score_correction_bias (empty: none)
  std::vector<Mlp> experts;
  bool has_shared = false;
  Mlp shared;
};

struct Layer {
  std::vector<float> input_norm, post_attention_norm;
  Attention attn;
  bool is_moe = false;
  Mlp mlp;  // dense layers
  Moe moe;  // MoE layers
};

struct ModelWeights {
  Tensor embed;  // [vocab, hidden], checkpoint dtype
  std::vector<Layer> layers;
  std::vector<float> final_norm;
  Linear lm_head;
  size_t weight_bytes = 0;  // bytes of all tensors in use (file sizes, not widened)

  // Finds every tensor the config needs, checks its shape, and rejects
  // checkpoints with unknown tensors (extra MTP layers are recognised).
  static ModelWeights load(const io::SafetensorsSet& st, const ModelConfig& cfg);
};

}  // namespace ds::model
