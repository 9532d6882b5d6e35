// DeepSeek-V4 training through the expert exchange (V4LossOptions::exchange)
// and through the FSDP stream (the family's streamed trees) on one rank,
// where both dispatch modes move every row to itself and every layer goes
// through the gather buffers: the loss, the gradients and the expert loads
// are those of the plain path bit for bit, under full remat too (the rerun
// exchanges again). The multi-rank runs, where rows and weights really
// travel, are in dist_mpi_test.sh.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "dist/fsdp.h"
#include "model/family.h"
#include "model/v4_train.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {
namespace v4_expert_parallel_test {

using namespace ds;

TEST(V4ExpertParallel, OneRankExchangeIsThePlainPath) {
  const auto rc = train::parse_run_config(
      "", {"model_name=" + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", "mtp_num_layers=1"}, "test");
  const auto& c = *rc.v4;
  auto p = model::V4FlatParams::zeros(c);
  model::init_v4_params(c, p, 3, 0.2f);
  uint64_t x = 17;
  auto next = [&] { return static_cast<int32_t>((x = x * 6364136223846793005ULL + 1442695040888963407ULL) >> 55); };
  model::V4TrainBatch b;
  b.lengths = {37, 22};
  for (int t = 0; t < 59; ++t) {
    b.inputs.push_back(next());
    b.targets.push_back(next());
  }
  model::V4LossOptions o;
  o.expert_load = true;
  auto g0 = model::V4FlatParams::zeros(c);
  const auto plain = model::v4_loss_and_grad(c, p.view, &g0.ptr, b, o);
  auto comm = dist::make_single();
  for (auto mode : {dist::ExpertExchange::Mode::AllToAll, dist::ExpertExchange::Mode::AllGather})
    for (const char* policy : {"", "full"}) {
      SCOPED_TRACE(std::string(mode == dist::ExpertExchange::Mode::AllToAll ? "alltoall " : "allgather ") + policy);
      dist::ExpertExchange ex(*comm, c.n_routed_experts, mode);
      auto g = model::V4FlatParams::zeros(c);
      o.exchange = &ex;
      o.remat = *policy ? model::RematPolicy::from_name(policy) : model::RematPolicy::keep_all();
      const auto t = model::v4_loss_and_grad(c, p.view, &g.ptr, b, o);
      EXPECT_EQ(t.loss, plain.loss);
      EXPECT_EQ(t.expert_load, plain.expert_load);
      EXPECT_TRUE(g.data == g0.data) << "the gradients differ";
    }
  // A rank without tokens would leave its peers waiting: one clear error.
  dist::ExpertExchange ex(*comm, c.n_routed_experts, dist::ExpertExchange::Mode::AllToAll);
  o.exchange = &ex;
  EXPECT_THROW(model::v4_loss_and_grad(c, p.view, nullptr, model::V4TrainBatch{}, o), Error);
}

TEST(V4Fsdp, OneRankStreamIsThePlainPath) {
  for (const char* mtp : {"mtp_num_layers=1", "mtp_num_layers=0"}) {
    SCOPED_TRACE(mtp);
    const auto rc = train::parse_run_config(
        "", {"model_name=" + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", mtp}, "test");
    const auto family = train::model_family(rc);
    const int64_t P = family->numel();
    std::vector<float> full(static_cast<size_t>(P)), g0(static_cast<size_t>(P), 0.0f);
    family->init(full.data(), 9, 0.2f);
    auto plain = family->bind(full.data(), g0.data());
    plain->params_changed();
    model::TrainBatch b;
    b.batch = 2;
    b.seq = 24;
    uint64_t x = 5;
    for (int64_t i = 0; i < 48; ++i) {
      b.inputs.push_back(static_cast<int32_t>((x = x * 6364136223846793005ULL + 1) >> 55));
      b.targets.push_back(static_cast<int32_t>((x = x * 6364136223846793005ULL + 1) >> 55));
      b.positions.push_back(static_cast<int32_t>(i % 24));
      b.segment_ids.push_back(1);
      b.target_segment_ids.push_back(1);
    }
    model::LossOptions o;
    o.mtp_num_layers = family->mtp_layers();
    o.load_balance_loss_weight = 0.01;
    o.z_loss_multiplier = 1e-3;
    const auto want = plain->loss_and_grad(b, o, model::RematPolicy::from_name("full"), true);
    auto comm = dist::make_single();
    auto sm = family->bind_streamed();
    ASSERT_NE(sm, nullptr);
    dist::FsdpParams fp(family->layout(), family->routed_experts(), sm->leaves, *comm, *comm, nullptr);
    fp.take_shard(full.data(), fp.shard.data());
    o.stream = &fp;
    for (int micro = 0; micro < 2; ++micro) {  // the second pass reuses the buffers
      fp.start_step();
      const auto got = sm->bound->loss_and_grad(b, o, model::RematPolicy::from_name("full"), true);
      fp.finish_grads();
      EXPECT_EQ(got.loss, want.loss);
      EXPECT_EQ(got.moe_lb_loss, want.moe_lb_loss);
      EXPECT_EQ(got.expert_load, want.expert_load);
      std::vector<float> gfull(static_cast<size_t>(P));
      fp.gather_full(fp.grad_shard.data(), gfull.data());
      ASSERT_TRUE(gfull == g0) << "the gradients differ";
    }
    // Forward only (an eval).
    fp.gather_resident();
    o.mtp_num_layers = 0;
    EXPECT_EQ(sm->bound->loss_and_grad(b, o, model::RematPolicy::keep_all(), false).loss, [&] {
      model::LossOptions e = o;
      e.stream = nullptr;
      return plain->loss_and_grad(b, e, model::RematPolicy::keep_all(), false).loss;
    }());
  }
}

}  // namespace v4_expert_parallel_test
}  // namespace
