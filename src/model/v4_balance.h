// MaxText's auxiliary load-balance loss on DeepSeek-V4's score-routed MoE
// layers (its hash-routed layers route by a table and have no balance to
// learn). For the tokens of one forward pass grouped into the packed rows
// they came from (row_of[t]; `rows` is the whole batch's row count, so a
// data-parallel shard's share sums with the others to the whole):
//
//   p[t]  = softmax over experts of (scores[t] + bias)   (sqrt-softplus scores)
//   f[b,e] = top-k hits of expert e in row b / T_b,  P[b,e] = mean of p[t,e] over row b
//   loss  = weight E / rows  sum_b sum_e f[b,e] P[b,e]
//
// T_b counts the row's tokens that the forward ran: V4 training never runs
// padding, where MaxText routes the padding tokens too and counts them.
#pragma once

#include <cstdint>
#include <vector>

namespace ds::model {

struct V4BalanceRows {
  std::vector<int64_t> row_of;  // per token of the pass: its row (0 .. local rows - 1)
  int64_t whole_rows = 0;       // the whole batch's rows
};

// scores [N, E] (unbiased), experts [N, K], bias [E] (null: none).
double v4_balance_loss(const float* scores, const int32_t* experts, const float* bias, const V4BalanceRows& rows,
                       int64_t E, int64_t K, double weight);
// dloss x its gradient through the softmax and sqrt(softplus) into the
// router logits: dlogits [N, E] +=.
void v4_balance_loss_backward(float* dlogits, const float* scores, const int32_t* experts, const float* bias,
                              const V4BalanceRows& rows, int64_t E, int64_t K, double weight, double dloss);

}  // namespace ds::model
