// DeepSeek-V4 under the batch-split schedule (V4LossOptions::batch_split):
// the batch's packed rows cut into parts whose layers run in turn, one
// part's expert exchange in flight while the next computes.
//
// - Cutting a batch changes nothing but the order of sums: the loss (its
//   terms, MTP and balance included) and the expert loads are the whole
//   batch's, the gradients agree to float32 rounding; for 2 and 4 parts,
//   under full remat too.
// - Through the token exchange (one rank, both modes) a split batch gives
//   the plain split path's results bit for bit.
// - The parts really interleave: in the timeline, part 1 computes while
//   part 0's exchange is in flight, in the forward and in the backward.
// - A factor that does not divide the rows, and a part without tokens while
//   peers wait on its collectives, are one clear error each.
// The multi-rank runs against one process are in dist_mpi_test.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "model/staged.h"
#include "model/v4_train.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {
namespace v4_batch_split_test {

using namespace ds;

const std::string kV4Tiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml";

struct Result {
  model::V4LossTerms terms;
  std::vector<float> grads;
};

class V4BatchSplit : public ::testing::Test {
 protected:
  void SetUp() override {
    rc_ = train::parse_run_config("", {"model_name=" + kV4Tiny, "mtp_num_layers=1"}, "test");
    const auto& c = *rc_.v4;
    params_ = model::V4FlatParams::zeros(c);
    model::init_v4_params(c, params_, 23, 0.2f);
    // Four packed rows: two documents in row 0, one in row 1, one in row 2,
    // two in row 3; a few targets not counted.
    uint64_t x = 7;
    auto next = [&] { return static_cast<int32_t>((x = x * 6364136223846793005ULL + 1442695040888963407ULL) >> 55); };
    batch_.lengths = {21, 19, 40, 33, 9, 30};
    batch_.row_of = {0, 0, 1, 2, 3, 3};
    batch_.packed_rows = 4;
    for (int t = 0; t < 152; ++t) {
      batch_.inputs.push_back(next());
      batch_.targets.push_back(next());
      batch_.counted.push_back(t % 17 != 3);
    }
  }

  model::V4LossOptions options(int64_t split, const char* remat = "") const {
    model::V4LossOptions o;
    o.batch_split = split;
    o.z_loss_multiplier = 1e-3;
    o.load_balance_loss_weight = 0.01;
    o.expert_load = true;
    o.remat = *remat ? model::RematPolicy::from_name(remat) : model::RematPolicy::keep_all();
    return o;
  }

  Result run(const model::V4LossOptions& o) const {
    auto g = model::V4FlatParams::zeros(*rc_.v4);
    auto t = model::v4_loss_and_grad(*rc_.v4, params_.view, &g.ptr, batch_, o);
    return {std::move(t), std::move(g.data)};
  }

  train::RunConfig rc_;
  model::V4FlatParams params_;
  model::V4TrainBatch batch_;
};

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

TEST_F(V4BatchSplit, PartsGiveTheWholeBatchsLossAndGradients) {
  const Result whole = run(options(1));
  ASSERT_GT(whole.terms.mtp_loss, 0);
  ASSERT_GT(whole.terms.moe_lb_loss, 0);
  for (const int64_t split : {2, 4})
    for (const char* remat : {"", "full"}) {
      SCOPED_TRACE("split " + std::to_string(split) + " " + remat);
      const Result r = run(options(split, remat));
      EXPECT_LT(relative(r.terms.loss, whole.terms.loss), 1e-6);
      EXPECT_LT(relative(r.terms.lm_loss, whole.terms.lm_loss), 1e-6);
      EXPECT_LT(relative(r.terms.z_loss, whole.terms.z_loss), 1e-6);
      EXPECT_LT(relative(r.terms.mtp_loss, whole.terms.mtp_loss), 1e-6);
      EXPECT_LT(relative(r.terms.moe_lb_loss, whole.terms.moe_lb_loss), 1e-6);
      EXPECT_EQ(r.terms.tokens, whole.terms.tokens);
      EXPECT_EQ(r.terms.mtp_tokens, whole.terms.mtp_tokens);
      EXPECT_EQ(r.terms.expert_load, whole.terms.expert_load);
      double diff = 0, norm = 0;
      size_t worst = 0;
      double worst_rel = 0;
      for (size_t i = 0; i < whole.grads.size(); ++i) {
        const double d = static_cast<double>(r.grads[i]) - whole.grads[i];
        diff += d * d;
        norm += static_cast<double>(whole.grads[i]) * whole.grads[i];
        const double rel = std::abs(d) / (std::abs(whole.grads[i]) + 1e-4);
        if (rel > worst_rel) worst_rel = rel, worst = i;
      }
      EXPECT_LT(std::sqrt(diff / norm), 1e-5)
          << "worst element " << worst << ": " << r.grads[worst] << " against " << whole.grads[worst];
    }
}

TEST_F(V4BatchSplit, ThroughTheExchangeItIsThePlainSplitBitForBit) {
  auto comm = dist::make_single();
  for (const char* remat : {"", "full"}) {
    const Result plain = run(options(2, remat));
    for (auto mode : {dist::ExpertExchange::Mode::AllToAll, dist::ExpertExchange::Mode::AllGather}) {
      SCOPED_TRACE(std::string(mode == dist::ExpertExchange::Mode::AllToAll ? "alltoall " : "allgather ") + remat);
      dist::ExpertExchange ex(*comm, rc_.v4->n_routed_experts, mode);
      auto o = options(2, remat);
      o.exchange = &ex;
      const Result r = run(o);
      EXPECT_EQ(r.terms.loss, plain.terms.loss);
      EXPECT_EQ(r.terms.expert_load, plain.terms.expert_load);
      EXPECT_TRUE(r.grads == plain.grads) << "the gradients differ";
    }
  }
}

TEST_F(V4BatchSplit, PartOneComputesWhilePartZerosExchangeIsInFlight) {
  auto comm = dist::make_single();
  dist::ExpertExchange ex(*comm, rc_.v4->n_routed_experts, dist::ExpertExchange::Mode::AllToAll);
  auto o = options(2);
  o.exchange = &ex;
  model::timeline_record(true);
  run(o);
  model::timeline_record(false);
  const auto spans = model::timeline_spans();
  // For each layer and direction: part 1 computing inside one of part 0's
  // communication spans.
  const int64_t L = rc_.v4->num_hidden_layers;
  for (const bool backward : {false, true})
    for (int64_t l = 0; l < L; ++l) {
      bool overlapped = false;
      for (const auto& c : spans) {
        if (c.layer != l || c.backward != backward || c.part != 0 || c.computing) continue;
        for (const auto& s : spans)
          overlapped |= s.layer == l && s.backward == backward && s.part == 1 && s.computing && s.t0 >= c.t0 &&
                        s.t1 <= c.t1 && s.t1 > s.t0;
      }
      EXPECT_TRUE(overlapped) << "layer " << l << (backward ? " backward" : " forward");
    }
}

TEST_F(V4BatchSplit, ImpossibleSplitsAreOneClearError) {
  auto o = options(3);  // 4 rows
  try {
    run(o);
    ADD_FAILURE() << "a factor of 3 over 4 rows ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide the 4 rows"), std::string::npos) << e.what();
  }
  // Row 1 holds only padding: alone a part without tokens is skipped, but
  // with the exchange its peers would wait on it.
  model::V4TrainBatch b = batch_;
  b.lengths = {21, 19, 40, 33};
  b.row_of = {0, 0, 2, 3};
  b.inputs.resize(113);
  b.targets.resize(113);
  b.counted.resize(113);
  auto g = model::V4FlatParams::zeros(*rc_.v4);
  o = options(4);
  EXPECT_NO_THROW(model::v4_loss_and_grad(*rc_.v4, params_.view, &g.ptr, b, o));
  auto comm = dist::make_single();
  dist::ExpertExchange ex(*comm, rc_.v4->n_routed_experts, dist::ExpertExchange::Mode::AllToAll);
  o.exchange = &ex;
  try {
    model::v4_loss_and_grad(*rc_.v4, params_.view, &g.ptr, b, o);
    ADD_FAILURE() << "a part without tokens ran through the exchange";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 of 4"), std::string::npos) << e.what();
  }
}

}  // namespace v4_batch_split_test
}  // namespace
