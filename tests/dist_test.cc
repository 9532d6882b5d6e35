// The pieces of multi-process training that one process can check: the
// single-process communicator, the mesh arithmetic of MaxText's
// ici_/dcn_*_parallelism keys with its errors, and an AdamW split into FSDP
// shards updating exactly as the whole one. (The MPI collectives themselves
// run under mpirun in dist_mpi_test.sh.)
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "dist/fsdp.h"
#include "dist/link_model.h"
#include "dist/mesh.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace ds {
namespace {
namespace dist_test {

using dist::MeshConfig;

const std::string kTiny =
    "model_name: " + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml\nmax_target_length: 8\n";

// rows x seq tokens, ids (mul t + add) mod V; each row two documents, the
// second from column `doc` on, and the target at the boundary not counted.
model::TrainBatch make_batch(const model::ModelConfig& cfg, int64_t rows, int64_t seq, int64_t mul, int64_t add,
                             int64_t doc) {
  model::TrainBatch b;
  b.batch = rows;
  b.seq = seq;
  for (int64_t t = 0; t < rows * seq; ++t) {
    const int32_t seg = 1 + (t % seq >= doc);
    b.inputs.push_back(static_cast<int32_t>((mul * t + add) % cfg.vocab_size));
    b.targets.push_back(static_cast<int32_t>((mul * t + add + 1) % cfg.vocab_size));
    b.positions.push_back(static_cast<int32_t>(t % seq >= doc ? t % seq - doc : t % seq));
    b.segment_ids.push_back(seg);
    b.target_segment_ids.push_back(t % seq == doc - 1 ? 0 : seg);
  }
  return b;
}

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
  const auto keys = MeshConfig::keys();
  EXPECT_EQ(keys.size(), 6u);
  EXPECT_NE(std::find(keys.begin(), keys.end(), "dcn_fsdp_parallelism"), keys.end());
  EXPECT_EQ(std::find(keys.begin(), keys.end(), "ici_tensor_parallelism"), keys.end());
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

// FSDP: AdamWs that each own some runs of the flat order, their values and
// gradients stored compactly elsewhere, update every element exactly as one
// AdamW over the whole buffer does (masks and weight decay included), and
// keep moments for their runs only.
TEST(ShardedAdamW, RunsUpdateAsTheWhole) {
  const auto rc = train::parse_run_config(kTiny, {"adamw_mask=[\"norm\"]", "adam_weight_decay=0.3"}, "test");
  const auto& cfg = rc.model;
  auto whole_p = model::FlatParams::zeros(cfg, 0), whole_g = model::FlatParams::zeros(cfg, 0);
  train::init_params(cfg, 0, whole_p, 7, 0.05f);
  for (size_t i = 0; i < whole_g.data.size(); ++i)
    whole_g.data[i] = static_cast<float>(std::sin(0.37 * double(i)) * 0.01);
  const int64_t P = static_cast<int64_t>(whole_p.data.size());
  // Three owners; seven runs of uneven length dealt round-robin.
  const int64_t cuts[8] = {0, P / 9, P / 5, P / 3, P / 2, 2 * P / 3, P - 17, P};
  std::vector<std::vector<float>> vals(3), grads(3);
  std::vector<std::vector<train::OwnedRange>> runs(3);
  for (int k = 0; k < 7; ++k) {
    const int o = k % 3;
    vals[o].insert(vals[o].end(), whole_p.data.begin() + cuts[k], whole_p.data.begin() + cuts[k + 1]);
    grads[o].insert(grads[o].end(), whole_g.data.begin() + cuts[k], whole_g.data.begin() + cuts[k + 1]);
  }
  for (int o = 0; o < 3; ++o) {
    int64_t at = 0;
    for (int k = o; k < 7; k += 3) {
      runs[o].push_back({cuts[k], cuts[k + 1], vals[o].data() + at, grads[o].data() + at});
      at += cuts[k + 1] - cuts[k];
    }
  }
  std::vector<std::unique_ptr<train::AdamW>> parts;
  for (int o = 0; o < 3; ++o) {
    parts.push_back(std::make_unique<train::AdamW>(cfg, 0, rc.train, runs[o]));
    EXPECT_EQ(parts.back()->m.size(), vals[o].size());
  }
  train::AdamW whole(cfg, 0, rc.train, whole_p, whole_g);
  for (int step = 0; step < 3; ++step) {
    whole.update(1e-2);
    for (auto& a : parts) a->update(1e-2);
  }
  for (int o = 0; o < 3; ++o) {
    int64_t at = 0;
    for (int k = o; k < 7; k += 3)
      for (int64_t i = cuts[k]; i < cuts[k + 1]; ++i, ++at) {
        ASSERT_EQ(vals[o][at], whole_p.data[i]) << "element " << i;
        ASSERT_EQ(parts[o]->m[at], whole.m[i]) << "moment " << i;
      }
  }
  double ss = 0, ws = 0;
  for (auto& a : parts)
    for (const auto& g : a->grad_spans())
      for (int64_t i = 0; i < g.n; ++i) ss += double(g.data[i]) * g.data[i];
  for (const auto& g : whole.grad_spans())
    for (int64_t i = 0; i < g.n; ++i) ws += double(g.data[i]) * g.data[i];
  EXPECT_GT(ws, 0.0);
  EXPECT_NEAR(ss, ws, 1e-12 * ws);  // the owners' spans partition the whole's
  // for_owned reaches exactly the owned elements of a range.
  int64_t seen = 0;
  for (auto& a : parts) a->for_owned(P / 4, P / 4 + 1000, [&](float*, int64_t, int64_t n) { seen += n; });
  EXPECT_EQ(seen, 1000);
}

// The FSDP stream on one rank: every layer goes through the gather buffers
// and every gradient through the reduce-scatter path, and the loss and
// gradients are bitwise those of the plain buffers; the shard helpers round-trip.
// Also for a model with mHC (k = 4 streams), whose modules are layer tensors.
TEST(Fsdp, OneRankStreamEqualsThePlainBuffers) {
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"mtp_num_layers=1"}, {"mtp_num_layers=0"}, {"mtp_num_layers=0", "mhc_expansion_rate=4"}}) {
    SCOPED_TRACE(extra.back());
    const auto rc = train::parse_run_config(kTiny, extra, "test");
    const auto& cfg = rc.model;
    const int64_t mtp = cfg.num_nextn_predict_layers;
    auto full = model::FlatParams::zeros(cfg, mtp), g = model::FlatParams::zeros(cfg, mtp);
    train::init_params(cfg, mtp, full, 3, 0.05f);
    auto comm = dist::make_single();
    dist::FsdpParams fp(cfg, mtp, *comm);
    fp.take_shard(full.data.data(), fp.shard.data());
    std::vector<float> back(full.data.size());
    fp.gather_full(fp.shard.data(), back.data());
    EXPECT_EQ(back, full.data);
    std::vector<float> packed(full.data.size(), 0.0f);
    fp.pack(fp.shard, packed);
    EXPECT_EQ(fp.expand(packed), fp.shard);

    const model::TrainBatch b = make_batch(cfg, 2, 8, 7, 3, 5);
    model::LossOptions o;
    o.mtp_num_layers = mtp;
    o.load_balance_loss_weight = 0.01;
    o.z_loss_multiplier = 1e-3;
    const auto plain = model::loss_and_grad(cfg, full.view, &g.ptr, b, o, model::RematPolicy::keep_all());
    o.stream = &fp;
    for (int micro = 0; micro < 2; ++micro) {  // the second pass reuses the buffers
      fp.start_step();
      const auto streamed = model::loss_and_grad(cfg, fp.view, &fp.grads, b, o, model::RematPolicy::keep_all());
      fp.finish_grads();
      EXPECT_EQ(streamed.loss, plain.loss);
      std::vector<float> gfull(full.data.size());
      fp.gather_full(fp.grad_shard.data(), gfull.data());
      ASSERT_EQ(gfull, g.data);
    }
    // Forward only (an eval).
    fp.gather_resident();
    o.mtp_num_layers = 0;
    o.stream = nullptr;
    const auto ev = model::loss_and_grad(cfg, full.view, nullptr, b, o, model::RematPolicy::keep_all());
    o.stream = &fp;
    EXPECT_EQ(model::loss_and_grad(cfg, fp.view, nullptr, b, o, model::RematPolicy::keep_all()).loss, ev.loss);
  }
}

// The expert exchange on one rank moves every row to itself: plan, dispatch
// and undispatch are identities, and the loss and gradients are bitwise
// those without an exchange, in both dispatch modes. (Across ranks:
// dist_mpi_test.sh.)
TEST(ExpertExchange, OneRankIsTheIdentity) {
  const auto rc = train::parse_run_config(kTiny, {"mtp_num_layers=1"}, "test");
  const auto& cfg = rc.model;
  const int64_t mtp = 1;
  auto p = model::FlatParams::zeros(cfg, mtp), g0 = model::FlatParams::zeros(cfg, mtp);
  train::init_params(cfg, mtp, p, 5, 0.05f);
  const model::TrainBatch b = make_batch(cfg, 2, 8, 11, 2, 8);
  model::LossOptions o;
  o.mtp_num_layers = mtp;
  o.load_balance_loss_weight = 0.01;
  const auto plain = model::loss_and_grad(cfg, p.view, &g0.ptr, b, o, model::RematPolicy::from_name("full", {}));
  auto comm = dist::make_single();
  for (auto mode : {dist::ExpertExchange::Mode::AllToAll, dist::ExpertExchange::Mode::AllGather}) {
    dist::ExpertExchange ex(*comm, cfg.n_routed_experts, mode);
    model::ExchangePlan plan;
    ex.plan(plan, {3, 0, 2, 1, 0, 0, 4, 1});
    EXPECT_EQ(plan.local_rows, 11);
    EXPECT_EQ(plan.rows, 11);
    EXPECT_EQ(plan.local_sizes, (std::vector<int32_t>{3, 0, 2, 1, 0, 0, 4, 1}));
    std::vector<float> rows(11 * 3), there(11 * 3), back(11 * 3);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
    ex.dispatch(there.data(), rows.data(), plan, 3);
    ex.undispatch(back.data(), there.data(), plan, 3);
    EXPECT_EQ(there, rows);
    EXPECT_EQ(back, rows);
    auto g = model::FlatParams::zeros(cfg, mtp);
    o.exchange = &ex;
    const auto t = model::loss_and_grad(cfg, p.view, &g.ptr, b, o, model::RematPolicy::from_name("full", {}));
    EXPECT_EQ(t.loss, plain.loss);
    EXPECT_EQ(g.data, g0.data);
  }
  // fp8 gradients: e5m2 with a per-row scale, within e5m2's rounding (2^-3
  // relative to the row's largest value), exact for a row of zeros.
  dist::ExpertExchange q(*comm, cfg.n_routed_experts, dist::ExpertExchange::Mode::AllGather, true);
  model::ExchangePlan plan;
  q.plan(plan, {2, 0, 0, 0, 0, 0, 0, 1});
  std::vector<float> rows = {1.0f, -3.5f, 1e-3f, 0.25f, 0, 0, 0, 0, 1e-6f, 2e-6f, -7e-7f, 5e-6f}, out(12);
  q.dispatch_gradient(out.data(), rows.data(), plan, 4);
  for (int r = 0; r < 3; ++r) {
    float amax = 0;
    for (int d = 0; d < 4; ++d) amax = std::max(amax, std::fabs(rows[r * 4 + d]));
    for (int d = 0; d < 4; ++d) EXPECT_NEAR(out[r * 4 + d], rows[r * 4 + d], 0.125 * amax) << r << " " << d;
  }
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_NE(out[8], rows[8]);  // it is quantized: 1e-6 of a row whose largest is 5e-6 is no e5m2 step
}

// The batch-split schedule on one rank: the batch's rows as two or four
// interleaved micro-batches per layer, with and without an expert exchange,
// under several remat policies, give the same loss and gradients as the
// whole batch (up to the order of the weight gradients' sums), and the same
// expert loads; with MTP, with mHC (k = 4 streams per token), and with
// Engram layers (each row its own sequence, so the parts hash alike).
void batch_split_matches_the_whole_batch(const train::RunConfig& rc);
TEST(BatchSplit, PartsGiveTheWholeBatchsLossAndGradient) {
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"mtp_num_layers=1"},
           {"mtp_num_layers=0", "mhc_expansion_rate=4"},
           {"mtp_num_layers=0", "mhc_expansion_rate=2", "engram_layers=[0, 2]", "engram_head_dim=8",
            "engram_num_heads=2", "engram_vocab_bases=[29, 31]"}}) {
    SCOPED_TRACE(extra.back());
    batch_split_matches_the_whole_batch(train::parse_run_config(kTiny, extra, "test"));
  }
}

void batch_split_matches_the_whole_batch(const train::RunConfig& rc) {
  const auto& cfg = rc.model;
  const int64_t mtp = cfg.num_nextn_predict_layers;
  auto p = model::FlatParams::zeros(cfg, mtp);
  train::init_params(cfg, mtp, p, 9, 0.05f);
  const model::TrainBatch b = make_batch(cfg, 4, 8, 13, 1, 5);
  model::LossOptions o;
  o.mtp_num_layers = mtp;
  o.load_balance_loss_weight = 0.01;
  o.z_loss_multiplier = 1e-3;
  auto comm = dist::make_single();
  dist::ExpertExchange ex(*comm, cfg.n_routed_experts, dist::ExpertExchange::Mode::AllToAll);
  // Every remat policy keeps working under the schedule (what it drops is
  // recomputed per micro-batch).
  for (const char* name : {"minimal", "full", "save_dot_except_mlpwi", "save_out_proj"}) {
    const auto policy = model::RematPolicy::from_name(name, {});
    auto g1 = model::FlatParams::zeros(cfg, mtp);
    const auto whole = model::loss_and_grad(cfg, p.view, &g1.ptr, b, o, policy);
    for (int64_t M : {2, 4})
      for (bool with_exchange : {false, true}) {
        SCOPED_TRACE(testing::Message() << name << ", " << M << " parts, exchange " << with_exchange);
        auto g = model::FlatParams::zeros(cfg, mtp);
        model::LossOptions om = o;
        om.batch_split_factor = M;
        om.exchange = with_exchange ? &ex : nullptr;
        const auto t = model::loss_and_grad(cfg, p.view, &g.ptr, b, om, policy);
        EXPECT_NEAR(t.loss, whole.loss, 1e-6 * whole.loss);
        EXPECT_NEAR(t.moe_lb_loss, whole.moe_lb_loss, 1e-6 * whole.moe_lb_loss);
        EXPECT_EQ(t.expert_load, whole.expert_load);
        double gmax = 0, err = 0;
        for (size_t i = 0; i < g.data.size(); ++i) {
          gmax = std::max(gmax, std::fabs(double(g1.data[i])));
          err = std::max(err, std::fabs(double(g.data[i]) - g1.data[i]));
        }
        EXPECT_LT(err, 1e-5 * gmax);
      }
  }
  auto g1 = model::FlatParams::zeros(cfg, mtp);
  const auto policy = model::RematPolicy::from_name("minimal", {});
  model::LossOptions bad = o;
  bad.batch_split_factor = 3;  // does not divide 4 rows
  EXPECT_THROW(model::loss_and_grad(cfg, p.view, &g1.ptr, b, bad, policy), Error);
}

// The schedule itself: an exchange that logs when each move starts and
// when it is finished. With one part every move is finished right after it
// starts; with two parts, every move but the last has the other part's move
// started (and its compute done) before it is finished: the overlap.
TEST(BatchSplit, MovesOverlapTheOtherPartsWork) {
  struct Logging final : model::TokenExchange {
    std::vector<std::pair<int, bool>> log;  // (move, finished)
    int next = 0;
    void plan(model::ExchangePlan& p, const std::vector<int32_t>& sizes) override {
      p.local_sizes = sizes;
      p.local_rows = 0;
      for (int32_t x : sizes) p.local_rows += x;
    }
    std::function<void()> start(float* out, const float* rows, const model::ExchangePlan& p, int64_t D) {
      const int id = next++;
      log.emplace_back(id, false);
      std::copy(rows, rows + p.local_rows * D, out);
      return [this, id] { log.emplace_back(id, true); };
    }
    std::function<void()> start_dispatch(float* out, const float* rows, const model::ExchangePlan& p, int64_t D,
                                         bool) override {
      return start(out, rows, p, D);
    }
    std::function<void()> start_undispatch(float* out, const float* rows, const model::ExchangePlan& p,
                                           int64_t D) override {
      return start(out, rows, p, D);
    }
  };
  const auto rc = train::parse_run_config(kTiny, {}, "test");
  const auto& cfg = rc.model;
  auto p = model::FlatParams::zeros(cfg, 0), g = model::FlatParams::zeros(cfg, 0);
  train::init_params(cfg, 0, p, 2, 0.05f);
  const model::TrainBatch b = make_batch(cfg, 2, 4, 1, 1, 4);
  for (int64_t M : {1, 2}) {
    Logging ex;
    model::LossOptions o;
    o.exchange = &ex;
    o.batch_split_factor = M;
    model::loss_and_grad(cfg, p.view, &g.ptr, b, o, model::RematPolicy::from_name("full", {}));
    // Moves whose finish comes after some other move's start.
    std::map<int, size_t> started;
    int overlapped = 0;
    for (size_t i = 0; i < ex.log.size(); ++i) {
      const auto [id, fin] = ex.log[i];
      if (!fin) {
        started[id] = i;
      } else {
        bool other = false;
        for (size_t j = started[id] + 1; j < i; ++j) other |= !ex.log[j].second;
        overlapped += other;
      }
    }
    ASSERT_GT(ex.next, 0);
    if (M == 1)
      EXPECT_EQ(overlapped, 0);
    else
      EXPECT_GE(overlapped, ex.next / 2) << "of " << ex.next << " moves";
  }
}

// The link model delivers no earlier than its latency (one rank moves no
// bytes) and counts what it modeled.
TEST(LinkModel, DeliversNoEarlierThanTheModel) {
  auto comm = dist::make_single();
  dist::LinkModel link(*comm, 0.03, 1e9);
  std::vector<float> a(1000, 1.0f), b(1000);
  const auto t0 = std::chrono::steady_clock::now();
  auto h1 = link.all_gather(a.data(), 1000, b.data());
  auto h2 = link.all_reduce(a.data(), 1000);
  h1.wait();
  h2.wait();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.03);
  EXPECT_EQ(b, a);
  EXPECT_NEAR(link.busy_seconds(), 0.06, 1e-12);  // two latencies, no bytes between one rank and itself
  EXPECT_EQ(link.bytes_received(), 0.0);
  EXPECT_THROW(dist::LinkModel(*comm, 0.0, 0.0), Error);
}

}  // namespace dist_test
}  // namespace
}  // namespace ds
