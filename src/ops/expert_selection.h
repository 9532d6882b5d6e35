// DeepSeekMoE expert selection: scores, aux-loss-free bias, group-limited
// top-k, and the combine weights, with the backward to the gate logits.
//
// Per token (logits l [E] = x @ gate.weight^T):
//   s = sigmoid(l)            (Sigmoid, V3)   or softmax(l) (Softmax, V2)
//     or sqrt(softplus(l))    (SqrtSoftplus, V4)
//   c = s + bias              (bias: e_score_correction_bias; null = none)
//   groups: E experts split into n_group consecutive groups; a group's score
//     is the sum of its two largest c (Top2Sum, noaux_tc) or its largest c
//     (Max, group_limited_greedy); the topk_group best groups stay, experts in
//     the others are masked to -inf (as DeepSeek's own inference code does).
//     GroupScore::None (greedy) skips this.
//   experts = top-k of the masked c (descending; ties to the lower index),
//     or the given `fixed` experts (V4's hash-routed layers: tid2eid[token])
//   w_k = s[experts_k];  if norm_topk_prob: w_k /= sum_j w_j;  w_k *= scale
// Backward (indices carry no gradient, bias gets none):
//   with S = sum_j s_j over the chosen experts and g_k = dL/dw_k,
//   norm:    dL/ds_k = scale * (g_k - sum_j g_j w_j / scale) / S
//            = (scale * g_k - sum_j g_j w_j) / S
//   no norm: dL/ds_k = scale * g_k
//   then through sigmoid (s (1 - s)), softmax over all E, or sqrt(softplus)
//   (sigmoid(l) / (2 s)) (`=` into dlogits).
#pragma once

#include <cstdint>

namespace ds::ops {

enum class ExpertScoring { Sigmoid, Softmax, SqrtSoftplus };
enum class GroupScore { None, Top2Sum, Max };

struct ExpertSelectionConfig {
  int64_t num_experts = 0;
  int64_t k = 1;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  ExpertScoring scoring = ExpertScoring::Sigmoid;
  GroupScore group_score = GroupScore::Top2Sum;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// logits [T, E]; bias [E] or null. Writes experts [T, k], weights [T, k] and
// the unbiased scores [T, E] (saved for backward). With fixed [T, k] (ids in
// [0, E)) those are the experts and bias and groups play no part.
void expert_selection_forward(int32_t* experts, float* weights, float* scores, const float* logits,
                              const float* bias, int64_t tokens, const ExpertSelectionConfig& cfg,
                              const int32_t* fixed = nullptr);
// dweights [T, k] -> dlogits [T, E] (`=`).
void expert_selection_backward(float* dlogits, const float* dweights, const float* scores, const int32_t* experts,
                               int64_t tokens, const ExpertSelectionConfig& cfg);

// Expert loads (tokens routed to each expert) and the aux-loss-free bias
// update of DeepSeek-V3: bias_e += rate * sign(mean_load - load_e).
void expert_load(int64_t* load, const int32_t* experts, int64_t tokens, int64_t k, int64_t num_experts);
void update_routing_bias(float* bias, const int64_t* load, int64_t num_experts, float rate);

}  // namespace ds::ops
