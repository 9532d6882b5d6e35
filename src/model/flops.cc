#include "model/flops.h"

#include <algorithm>

namespace ds::model {

double forward_flops(const ModelConfig& c, int64_t batch, int64_t seq, int64_t head_rows, int64_t mtp_layers) {
  const double D = static_cast<double>(c.hidden_size), H = static_cast<double>(c.num_attention_heads);
  const double tok = static_cast<double>(batch) * static_cast<double>(seq), T = static_cast<double>(seq);
  const double nope = static_cast<double>(c.qk_nope_head_dim), rope = static_cast<double>(c.qk_rope_head_dim);
  const double vd = static_cast<double>(c.v_head_dim), ql = static_cast<double>(c.q_lora_rank);
  const double kvl = static_cast<double>(c.kv_lora_rank);
  auto ffn = [&](double F) { return 3 * F * D; };  // gate, up, down per token
  // Weights a token meets in layer l (multiply-adds; x 2 for FLOPs below).
  auto layer = [&](int64_t l) {
    double w = c.q_lora_rank > 0 ? D * ql + ql * H * (nope + rope) : D * H * (nope + rope);
    w += D * (kvl + rope) + kvl * H * (nope + vd) + D * H * vd;
    if (c.is_moe_layer(l))
      w += D * static_cast<double>(c.n_routed_experts) +
           static_cast<double>(c.n_shared_experts + c.num_experts_per_tok) *
               ffn(static_cast<double>(c.moe_intermediate_size));
    else
      w += ffn(static_cast<double>(c.intermediate_size));
    // Engram: its key (one per stream) and value projections of the rows looked up.
    if (l < c.num_hidden_layers && c.has_engram(l))
      w += static_cast<double>(c.mhc_expansion_rate + 1) * D * static_cast<double>(c.engram_columns()) *
           static_cast<double>(c.engram_head_dim);
    return w;
  };
  double per_token = 0;
  const int64_t layers = c.num_hidden_layers + mtp_layers;
  for (int64_t l = 0; l < layers; ++l) per_token += layer(l);
  const double head = D * static_cast<double>(c.vocab_size);  // unembedding, per row
  const double attn = 2.0 * tok * T * H * (nope + rope + vd) / 2 * static_cast<double>(layers);
  return 2 * tok * per_token + 2 * static_cast<double>(head_rows) * head + attn;
}

double step_flops(const ModelConfig& c, int64_t batch, int64_t seq, int64_t mtp_layers, int64_t grad_accum) {
  return 3 * forward_flops(c, batch, seq, batch * seq, mtp_layers) * static_cast<double>(grad_accum);
}

double v4_forward_flops(const V4Config& c, int64_t batch, int64_t seq, int64_t head_rows) {
  const double d = static_cast<double>(c.hidden_size), H = static_cast<double>(c.num_attention_heads);
  const double Dh = static_cast<double>(c.head_dim), ql = static_cast<double>(c.q_lora_rank);
  const double tok = static_cast<double>(batch) * static_cast<double>(seq), T = static_cast<double>(seq);
  const double ffn = 3 * d * static_cast<double>(c.moe_intermediate_size);
  double per_token = 0, attn = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t m = c.compress_ratio(l);
    double w = d * ql + ql * H * Dh + d * Dh;  // q-LoRA, K=V latent
    w += H * Dh * static_cast<double>(c.o_lora_rank) + static_cast<double>(c.o_groups * c.o_lora_rank) * d;
    if (c.owns_compressor(l)) w += 2 * d * (m == 4 ? 2 : 1) * Dh;  // compressor projections
    // V4.1's Engram: the fused key and value projection.
    if (c.engram_slot(l) >= 0)
      w += static_cast<double>((c.hc_mult + 1) * c.hidden_size) *
           static_cast<double>(c.engram_columns() * c.engram_head_dim);
    w += d * static_cast<double>(c.n_routed_experts) +
         static_cast<double>(c.n_shared_experts + c.num_experts_per_tok) * ffn;
    per_token += w;
    // Keys per query on average: the window, and the compressed entries
    // (all of them on HCA layers, the indexer's top-k on CSA ones).
    double keys = std::min(static_cast<double>(c.sliding_window), (T + 1) / 2);
    if (m > 0) keys += c.sparse_entries(l) ? std::min(static_cast<double>(c.index_topk), T / (2 * m)) : T / (2 * m);
    attn += 2.0 * tok * keys * H * Dh * 2;  // scores and the weighted sum (K = V)
  }
  const double head = d * static_cast<double>(c.vocab_size);  // unembedding, per row
  return 2 * tok * per_token + 2 * static_cast<double>(head_rows) * head + attn;
}

double v4_step_flops(const V4Config& c, int64_t batch, int64_t seq, int64_t grad_accum) {
  return 3 * v4_forward_flops(c, batch, seq, batch * seq) * static_cast<double>(grad_accum);
}

}  // namespace ds::model
