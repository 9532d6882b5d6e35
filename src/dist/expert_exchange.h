// Expert parallelism over the expert axis: rank x of X computes experts
// [x E/X, (x + 1) E/X). Two ways to move the rows (expert_dispatch):
//   alltoall   every rank's routed rows reach their expert's rank by one
//              all-to-all of only those rows; the results come back by the
//              reverse all-to-all;
//   allgather  the seed's: every rank all-gathers every rank's routed rows
//              (padded to the longest), keeps those of its experts, and the
//              results go back by a reduce-scatter of the whole [ranks,
//              rows] buffer in which each rank filled in only its experts'
//              rows (X times the data of alltoall, and no per-pair counts).
// With fp8_gradients the backward's dispatch of the expert outputs'
// gradient (the transpose of undispatch: in allgather mode the all-gather
// that is the backward of the seed's quantized_psum_scatter) moves e5m2
// values with one float32 scale per row (max |row| / 57344), as the seed
// does; the forward stays float32.
//
// plan(): the ranks all-gather their rows per expert [X, E]; this rank sends
// rank q the rows of q's experts (a contiguous block, since route sorts rows
// by expert) and receives, from each rank in turn, its rows of this rank's
// experts; `place` then orders the received rows by expert (for each expert,
// rank 0's rows first), which is the order the grouped expert compute wants.
#pragma once

#include "dist/communicator.h"
#include "model/stages.h"

namespace ds::dist {

class ExpertExchange final : public model::TokenExchange {
 public:
  enum class Mode { AllToAll, AllGather };
  // experts: the model's routed experts (a multiple of expert.size()).
  ExpertExchange(Communicator& expert, int64_t experts, Mode mode, bool fp8_gradients = false);

  void plan(model::ExchangePlan& p, const std::vector<int32_t>& sizes) override;
  std::function<void()> start_dispatch(float* out, const float* rows, const model::ExchangePlan& p, int64_t D,
                                       bool gradient) override;
  std::function<void()> start_undispatch(float* out, const float* rows, const model::ExchangePlan& p,
                                         int64_t D) override;

  int64_t experts_per_rank() const { return per_rank_; }

 private:
  Communicator& comm_;
  int64_t E_, X_, rank_, per_rank_;
  Mode mode_;
  bool fp8_gradients_;
  // dispatch for rows of W elements of T: starts the collective, returns
  // what completes out.
  template <typename T>
  std::function<void()> start_move(T* out, const T* rows, const model::ExchangePlan& p, int64_t W);
};

}  // namespace ds::dist
