#include "dist/expert_exchange.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace ds::dist {

ExpertExchange::ExpertExchange(Communicator& expert, int64_t experts, Mode mode)
    : comm_(expert), E_(experts), X_(expert.size()), rank_(expert.rank()), mode_(mode) {
  DS_CHECK(X_ >= 1 && E_ % X_ == 0,
           "expert parallelism {} does not divide the {} routed experts: every rank must own as many", X_, E_);
  per_rank_ = E_ / X_;
}

void ExpertExchange::plan(model::ExchangePlan& p, const std::vector<int32_t>& sizes) {
  DS_CHECK(static_cast<int64_t>(sizes.size()) == E_, "internal: exchange plan for {} experts, not {}", sizes.size(),
           E_);
  std::vector<int32_t> all(static_cast<size_t>(X_ * E_));
  comm_.all_gather(sizes.data(), E_, all.data()).wait();
  const int64_t e0 = rank_ * per_rank_, e1 = e0 + per_rank_;
  p.local_sizes.assign(static_cast<size_t>(E_), 0);
  p.send_rows.assign(static_cast<size_t>(X_), 0);
  p.recv_rows.assign(static_cast<size_t>(X_), 0);
  for (int64_t e = 0; e < E_; ++e) p.send_rows[e / per_rank_] += sizes[e];
  for (int64_t x = 0; x < X_; ++x)
    for (int64_t e = e0; e < e1; ++e) {
      p.recv_rows[x] += all[x * E_ + e];
      p.local_sizes[e] += all[x * E_ + e];
    }
  // Where each expert's rows start in expert order, then each sender's share.
  std::vector<int64_t> next(static_cast<size_t>(E_), 0);
  int64_t at = 0;
  for (int64_t e = e0; e < e1; ++e) {
    next[e] = at;
    at += p.local_sizes[e];
  }
  p.local_rows = at;
  p.place.assign(static_cast<size_t>(at), 0);
  p.source.assign(static_cast<size_t>(at), 0);
  p.max_rows = 0;
  for (int64_t x = 0; x < X_; ++x) {
    int64_t n = 0;
    for (int64_t e = 0; e < E_; ++e) n += all[x * E_ + e];
    p.max_rows = std::max(p.max_rows, n);
  }
  int64_t i = 0;
  for (int64_t x = 0; x < X_; ++x) {
    int64_t row = 0;  // row of sender x's own order (sorted by expert)
    for (int64_t e = 0; e < E_; ++e)
      for (int32_t k = 0; k < all[x * E_ + e]; ++k, ++row)
        if (e >= e0 && e < e1) {
          p.source[next[e]] = x * p.max_rows + row;
          p.place[i++] = next[e]++;
        }
  }
}

void ExpertExchange::dispatch(float* out, const float* rows, const model::ExchangePlan& p, int64_t D) {
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(float);
  if (mode_ == Mode::AllGather) {
    std::vector<float> mine(static_cast<size_t>(p.max_rows * D), 0.0f), all(static_cast<size_t>(X_ * p.max_rows * D));
    int64_t n = 0;
    for (int64_t v : p.send_rows) n += v;
    if (n > 0) std::memcpy(mine.data(), rows, static_cast<size_t>(n) * row_bytes);
    comm_.all_gather(mine.data(), p.max_rows * D, all.data()).wait();
    for (int64_t j = 0; j < p.local_rows; ++j) std::memcpy(out + j * D, all.data() + p.source[j] * D, row_bytes);
    return;
  }
  std::vector<int64_t> sc(p.send_rows), rc(p.recv_rows);
  for (auto& v : sc) v *= D;
  for (auto& v : rc) v *= D;
  std::vector<float> got(static_cast<size_t>(p.local_rows * D));
  comm_.all_to_all(rows, sc.data(), got.data(), rc.data()).wait();
  for (int64_t i = 0; i < p.local_rows; ++i)
    std::memcpy(out + p.place[i] * D, got.data() + i * D, static_cast<size_t>(D) * sizeof(float));
}

void ExpertExchange::undispatch(float* out, const float* rows, const model::ExchangePlan& p, int64_t D) {
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(float);
  if (mode_ == Mode::AllGather) {
    // Each row has exactly one rank that filled it in: the sum is that rank's value.
    std::vector<float> all(static_cast<size_t>(X_ * p.max_rows * D), 0.0f), mine(static_cast<size_t>(p.max_rows * D));
    for (int64_t j = 0; j < p.local_rows; ++j) std::memcpy(all.data() + p.source[j] * D, rows + j * D, row_bytes);
    comm_.reduce_scatter(all.data(), p.max_rows * D, mine.data()).wait();
    int64_t n = 0;
    for (int64_t v : p.send_rows) n += v;
    if (n > 0) std::memcpy(out, mine.data(), static_cast<size_t>(n) * row_bytes);
    return;
  }
  std::vector<int64_t> sc(p.recv_rows), rc(p.send_rows);
  for (auto& v : sc) v *= D;
  for (auto& v : rc) v *= D;
  std::vector<float> give(static_cast<size_t>(p.local_rows * D));
  for (int64_t i = 0; i < p.local_rows; ++i)
    std::memcpy(give.data() + i * D, rows + p.place[i] * D, static_cast<size_t>(D) * sizeof(float));
  comm_.all_to_all(give.data(), sc.data(), out, rc.data()).wait();
}

}  // namespace ds::dist
