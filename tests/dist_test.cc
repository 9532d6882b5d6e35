// The pieces of multi-process training that one process can check: the
// single-process communicator, the mesh arithmetic of MaxText's
// ici_/dcn_*_parallelism keys with its errors, and an AdamW split into FSDP
// shards updating exactly as the whole one. (The MPI collectives themselves
// run under mpirun in dist_mpi_test.sh.)
#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace ds {
namespace {

using dist::MeshConfig;

const std::string kTiny =
    "model_name: " + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml\nmax_target_length: 8\n";

TEST(Single, CollectivesAreCopies) {
  auto c = dist::make_single();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  std::vector<float> a = {1, 2, 3}, b(3, 0);
  c->all_reduce(a.data(), 3).wait();
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  c->all_gather(a.data(), 3, b.data()).wait();
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.0f);
  c->reduce_scatter(a.data(), 3, b.data()).wait();
  EXPECT_EQ(b, a);
  const int64_t n3 = 3;
  std::fill(b.begin(), b.end(), 0.0f);
  c->all_to_all(a.data(), &n3, b.data(), &n3).wait();
  EXPECT_EQ(b, a);
  const int64_t n2 = 2;
  EXPECT_THROW(c->all_to_all(a.data(), &n3, b.data(), &n2), Error);
  EXPECT_THROW(c->broadcast(a.data(), 3, 1), Error);
  c->barrier().wait();
  EXPECT_EQ(c->split(0, 0)->size(), 1);
}

TEST(Mesh, FillsTheRestAndChecksTheWorld) {
  MeshConfig m;  // MaxText's defaults: ici_fsdp=-1, dcn_data=-1
  EXPECT_EQ(dist::resolve_mesh(m, 4, 4), (std::array<int64_t, 3>{1, 4, 1}));
  EXPECT_EQ(dist::resolve_mesh(m, 8, 4), (std::array<int64_t, 3>{2, 4, 1}));  // two nodes replicate
  m.set("ici_data_parallelism", 2);
  EXPECT_EQ(dist::resolve_mesh(m, 4, 4), (std::array<int64_t, 3>{2, 2, 1}));
  m.set("ici_expert_parallelism", 2);
  m.set("ici_fsdp_parallelism", 1);
  EXPECT_EQ(dist::resolve_mesh(m, 4, 4), (std::array<int64_t, 3>{2, 1, 2}));
  m.set("dcn_data_parallelism", 1);
  m.set("dcn_fsdp_parallelism", -1);
  EXPECT_EQ(dist::resolve_mesh(m, 8, 4), (std::array<int64_t, 3>{2, 2, 2}));

  MeshConfig bad;
  bad.set("ici_data_parallelism", 3);
  EXPECT_THROW(dist::resolve_mesh(bad, 4, 4), Error);  // 3 does not divide 4
  bad.set("ici_fsdp_parallelism", 1);
  EXPECT_THROW(dist::resolve_mesh(bad, 4, 4), Error);  // 3 x 1 x 1 != 4
  MeshConfig two;
  two.set("ici_data_parallelism", -1);
  EXPECT_THROW(dist::resolve_mesh(two, 4, 4), Error);           // two axes fill the rest
  EXPECT_THROW(dist::resolve_mesh(MeshConfig{}, 6, 4), Error);  // nodes of unequal size
  EXPECT_THROW(MeshConfig{}.set("ici_data_parallelism", 0), Error);
  EXPECT_TRUE(MeshConfig::is_key("dcn_fsdp_parallelism"));
  EXPECT_FALSE(MeshConfig::is_key("ici_tensor_parallelism"));
}

TEST(Mesh, OneProcessIsOneShardOnEveryAxis) {
  auto c = dist::make_single();
  dist::Mesh mesh(*c, MeshConfig{}, 1);
  for (auto a : {dist::kData, dist::kFsdp, dist::kExpert}) {
    EXPECT_EQ(mesh.size(a), 1);
    EXPECT_EQ(mesh.coord(a), 0);
    EXPECT_EQ(mesh.axis(a).size(), 1);
  }
  EXPECT_EQ(mesh.batch_shards(), 1);
}

TEST(Mesh, TrainingConfigTakesTheKeys) {
  const auto rc = train::parse_run_config(
      kTiny,
      {"ici_data_parallelism=2", "ici_fsdp_parallelism=1", "dcn_fsdp_parallelism=-1", "collective_timeout_seconds=7"},
      "test");
  EXPECT_EQ(rc.train.mesh.ici[dist::kData], 2);
  EXPECT_EQ(rc.train.mesh.ici[dist::kFsdp], 1);
  EXPECT_EQ(rc.train.mesh.dcn[dist::kFsdp], -1);
  EXPECT_EQ(rc.train.collective_timeout_seconds, 7);
  EXPECT_THROW(train::parse_run_config(kTiny, {"ici_data_parallelism=0"}, "test"), Error);
  EXPECT_THROW(train::parse_run_config(kTiny, {"collective_timeout_seconds=-1"}, "test"), Error);
}

// FSDP: AdamWs over the shards [0, S) and [S, 2S) of a padded buffer update
// every element exactly as one AdamW over the whole buffer does, masks and
// weight decay included, and keep moments for their shard only.
TEST(ShardedAdamW, ShardsUpdateAsTheWhole) {
  const auto rc = train::parse_run_config(kTiny, {"adamw_mask=[\"norm\"]", "adam_weight_decay=0.3"}, "test");
  const auto& cfg = rc.model;
  const int64_t F = 3;  // a shard count that does not divide the tree: padding
  auto whole_p = model::FlatParams::zeros(cfg, 0, F), whole_g = model::FlatParams::zeros(cfg, 0, F);
  ASSERT_EQ(whole_p.data.size() % F, 0u);
  ASSERT_GT(whole_p.data.size(), static_cast<size_t>(model::FlatParams::numel(cfg, 0)));
  train::init_params(cfg, 0, whole_p, 7, 0.05f);
  for (size_t i = 0; i < whole_g.data.size(); ++i) whole_g.data[i] = std::sin(0.37 * double(i)) * 0.01f;
  const int64_t P = static_cast<int64_t>(whole_p.data.size()), S = P / F;

  std::vector<model::FlatParams> sp, sg;
  std::vector<std::unique_ptr<train::AdamW>> shards;
  for (int64_t f = 0; f < F; ++f) {
    sp.push_back(model::FlatParams::zeros(cfg, 0, F));
    sg.push_back(model::FlatParams::zeros(cfg, 0, F));
  }
  for (int64_t f = 0; f < F; ++f) {
    std::copy(whole_p.data.begin(), whole_p.data.end(), sp[f].data.begin());
    std::copy(whole_g.data.begin(), whole_g.data.end(), sg[f].data.begin());
    shards.push_back(std::make_unique<train::AdamW>(cfg, 0, rc.train, sp[f], sg[f], f * S, (f + 1) * S));
    EXPECT_EQ(static_cast<int64_t>(shards.back()->m.size()), S);
  }
  train::AdamW whole(cfg, 0, rc.train, whole_p, whole_g);
  for (int step = 0; step < 3; ++step) {
    whole.update(1e-2);
    for (auto& s : shards) s->update(1e-2);
  }
  int64_t changed = 0;
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = f * S; i < (f + 1) * S; ++i) {
      ASSERT_EQ(sp[f].data[i], whole_p.data[i]) << "element " << i << " of shard " << f;
      ASSERT_EQ(shards[f]->m[i - f * S], whole.m[i]);
    }
  // Outside its shard an AdamW changes nothing.
  for (int64_t i = S; i < P; ++i) changed += sp[0].data[i] != whole_p.data[i];
  EXPECT_GT(changed, 0);
  double ss = 0;
  for (auto& s : shards)
    for (const auto& g : s->grad_spans())
      for (int64_t i = 0; i < g.n; ++i) ss += double(g.data[i]) * g.data[i];
  double ws = 0;
  for (const auto& g : whole.grad_spans())
    for (int64_t i = 0; i < g.n; ++i) ws += double(g.data[i]) * g.data[i];
  EXPECT_NEAR(ss, ws, 1e-12 * ws);  // the shards' spans partition the whole's
}

}  // namespace
}  // namespace ds
