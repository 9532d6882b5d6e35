// DeepSeek-V4 training through the expert exchange (V4LossOptions::exchange)
// on one rank, where both dispatch modes move every row to itself: the
// loss, the gradients and the expert loads are those of the plain path bit
// for bit, under full remat too (the rerun exchanges again). The two-rank
// runs, where rows really travel, are in dist_mpi_test.sh.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "model/v4_train.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {

using namespace ds;

TEST(V4ExpertParallel, OneRankExchangeIsThePlainPath) {
  const auto rc = train::parse_run_config(
      "", {"model_name=" + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", "mtp_num_layers=1"}, "test");
  const auto& c = *rc.v4;
  auto p = model::V4FlatParams::zeros(c);
  train::init_v4_params(c, p, 3, 0.2f);
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

}  // namespace
