#include "dist/expert_exchange.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/dtype.h"
#include "core/error.h"

namespace ds::dist {

ExpertExchange::ExpertExchange(Communicator& expert, int64_t experts, Mode mode, bool fp8_gradients)
    : comm_(expert), E_(experts), X_(expert.size()), rank_(expert.rank()), mode_(mode), fp8_gradients_(fp8_gradients) {
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
  p.rows = 0;
  for (int64_t e = 0; e < E_; ++e) {
    p.send_rows[e / per_rank_] += sizes[e];
    p.rows += sizes[e];
  }
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

template <typename T>
std::function<void()> ExpertExchange::start_move(T* out, const T* rows, const model::ExchangePlan& p, int64_t W) {
  const size_t row_bytes = static_cast<size_t>(W) * sizeof(T);
  const int64_t local = p.local_rows;
  if (mode_ == Mode::AllGather) {
    auto mine = std::make_shared<std::vector<T>>(static_cast<size_t>(p.max_rows * W), T{});
    auto all = std::make_shared<std::vector<T>>(static_cast<size_t>(X_ * p.max_rows * W));
    const int64_t n = p.rows;
    if (n > 0) std::memcpy(mine->data(), rows, static_cast<size_t>(n) * row_bytes);
    Handle h = comm_.all_gather(mine->data(), p.max_rows * W, all->data());
    const int64_t* source = p.source.data();
    return [h, mine, all, out, source, local, W, row_bytes]() mutable {
      h.wait();
      for (int64_t j = 0; j < local; ++j) std::memcpy(out + j * W, all->data() + source[j] * W, row_bytes);
    };
  }
  std::vector<int64_t> sc(p.send_rows), rc(p.recv_rows);
  for (auto& v : sc) v *= W;
  for (auto& v : rc) v *= W;
  auto got = std::make_shared<std::vector<T>>(static_cast<size_t>(local * W));
  Handle h = comm_.all_to_all(rows, sc.data(), got->data(), rc.data());
  const int64_t* place = p.place.data();
  return [h, got, out, place, local, W, row_bytes]() mutable {
    h.wait();
    for (int64_t i = 0; i < local; ++i) std::memcpy(out + place[i] * W, got->data() + i * W, row_bytes);
  };
}

std::function<void()> ExpertExchange::start_dispatch(float* out, const float* rows, const model::ExchangePlan& p,
                                                     int64_t D, bool gradient) {
  if (!gradient || !fp8_gradients_) return start_move(out, rows, p, D);
  const int64_t n = p.rows;
  auto q = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(n * D));
  auto q_out = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(p.local_rows * D));
  auto scale = std::make_shared<std::vector<float>>(static_cast<size_t>(n));
  auto scale_out = std::make_shared<std::vector<float>>(static_cast<size_t>(p.local_rows));
  constexpr float kE5m2Max = 57344.0f;
  for (int64_t i = 0; i < n; ++i) {
    float amax = 0;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(rows[i * D + d]));
    (*scale)[i] = amax / kE5m2Max;
    const float inv = amax > 0 ? kE5m2Max / amax : 0.0f;
    for (int64_t d = 0; d < D; ++d) (*q)[i * D + d] = f32_to_e5m2(rows[i * D + d] * inv);
  }
  auto fq = start_move(q_out->data(), q->data(), p, D);
  auto fs = start_move(scale_out->data(), scale->data(), p, 1);
  const int64_t local = p.local_rows;
  return [fq, fs, q, q_out, scale, scale_out, out, local, D]() mutable {
    fq();
    fs();
    for (int64_t j = 0; j < local; ++j)
      for (int64_t d = 0; d < D; ++d) out[j * D + d] = e5m2_to_f32((*q_out)[j * D + d]) * (*scale_out)[j];
  };
}

std::function<void()> ExpertExchange::start_undispatch(float* out, const float* rows, const model::ExchangePlan& p,
                                                       int64_t D) {
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(float);
  if (mode_ == Mode::AllGather) {
    // Each row has exactly one rank that filled it in: the sum is that rank's value.
    auto all = std::make_shared<std::vector<float>>(static_cast<size_t>(X_ * p.max_rows * D), 0.0f);
    auto mine = std::make_shared<std::vector<float>>(static_cast<size_t>(p.max_rows * D));
    for (int64_t j = 0; j < p.local_rows; ++j) std::memcpy(all->data() + p.source[j] * D, rows + j * D, row_bytes);
    Handle h = comm_.reduce_scatter(all->data(), p.max_rows * D, mine->data());
    const int64_t n = p.rows;
    return [h, all, mine, out, n, row_bytes]() mutable {
      h.wait();
      if (n > 0) std::memcpy(out, mine->data(), static_cast<size_t>(n) * row_bytes);
    };
  }
  std::vector<int64_t> sc(p.recv_rows), rc(p.send_rows);
  for (auto& v : sc) v *= D;
  for (auto& v : rc) v *= D;
  auto give = std::make_shared<std::vector<float>>(static_cast<size_t>(p.local_rows * D));
  for (int64_t i = 0; i < p.local_rows; ++i) std::memcpy(give->data() + i * D, rows + p.place[i] * D, row_bytes);
  Handle h = comm_.all_to_all(give->data(), sc.data(), out, rc.data());
  return [h, give]() mutable { h.wait(); };
}

}  // namespace ds::dist
