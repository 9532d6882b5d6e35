// Every collective of the MPI communicator against values each rank can
// predict, run by dist_mpi_test.sh under `mpirun -np 1|2|4`: sums and maxima
// of several element types (one buffer large enough for a multi-megabyte
// transfer), all_gather in place and not, reduce_scatter, all_to_all with
// uneven counts, broadcast from the last rank, many operations in flight at
// once waited in reverse order, an operation that completes while the caller
// computes (the progress thread at work, no wait called), split, and the
// mesh's axis communicators; and the sharded parameters of every mesh the
// world allows with an expert axis (FsdpParams): the shards tile the model
// once per data replica, round-trip through take_shard and gather_full, a
// streamed layer shows the dense tensors and this rank's experts with their
// values and no other expert, and the expert axis shrinks what a rank holds.
// Exits 1 with one line on the first mismatch.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/fsdp.h"
#include "dist/mesh.h"
#include "train/config.h"

namespace {

using namespace ds;

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    fmt::print(stderr, "rank {}: FAILED {}\n", dist::world().rank(), what);
    ++failures;
  }
}

void run() {
  dist::Communicator& w = dist::world();
  const int R = w.rank(), N = w.size();
  expect(w.backend() == "mpi", "backend is mpi, got " + w.backend());
  if (const char* s = std::getenv("OMPI_COMM_WORLD_SIZE")) expect(std::atoi(s) == N, "world size");

  // all_reduce: sum and max, float, double, int64; 1M floats.
  std::vector<float> f(1 << 20);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>((R + 1) * (i % 7));
  w.all_reduce(f.data(), static_cast<int64_t>(f.size())).wait();
  const float tri = static_cast<float>(N * (N + 1) / 2);
  bool ok = true;
  for (size_t i = 0; i < f.size(); ++i) ok &= f[i] == tri * static_cast<float>(i % 7);
  expect(ok, "all_reduce sum of 1M floats");
  double d = R + 0.5;
  w.all_reduce(&d, 1, dist::ReduceOp::Max).wait();
  expect(d == N - 0.5, "all_reduce max double");
  int64_t big[2] = {int64_t(1) << 40, R};
  w.all_reduce(big, 2).wait();
  expect(big[0] == (int64_t(1) << 40) * N && big[1] == int64_t(N) * (N - 1) / 2, "all_reduce sum int64");

  // all_gather, separate buffers and in place.
  std::vector<float> mine = {float(R), float(10 * R)}, all(2 * N, -1);
  w.all_gather(mine.data(), 2, all.data()).wait();
  ok = true;
  for (int r = 0; r < N; ++r) ok &= all[2 * r] == r && all[2 * r + 1] == 10 * r;
  expect(ok, "all_gather");
  std::vector<double> inplace(3 * N, -1);
  for (int j = 0; j < 3; ++j) inplace[3 * R + j] = 100 * R + j;
  w.all_gather(inplace.data() + 3 * R, 3, inplace.data()).wait();
  ok = true;
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < 3; ++j) ok &= inplace[3 * r + j] == 100 * r + j;
  expect(ok, "all_gather in place");

  // reduce_scatter: rank r gets sum over ranks q of send_q[r * 4 + i] = q + r + i.
  std::vector<float> send(4 * N), recv(4);
  for (int r = 0; r < N; ++r)
    for (int i = 0; i < 4; ++i) send[4 * r + i] = static_cast<float>(R + r + i);
  w.reduce_scatter(send.data(), 4, recv.data()).wait();
  ok = true;
  for (int i = 0; i < 4; ++i) ok &= recv[i] == static_cast<float>(N * (N - 1) / 2 + N * (R + i));
  expect(ok, "reduce_scatter");

  // all_to_all: R sends R + q + 1 elements to q, valued 1000 R + 10 q + i.
  std::vector<int64_t> sc(N), rc(N);
  std::vector<int32_t> out, in;
  for (int q = 0; q < N; ++q) {
    sc[q] = R + q + 1;
    rc[q] = q + R + 1;
    for (int i = 0; i < sc[q]; ++i) out.push_back(1000 * R + 10 * q + i);
  }
  in.assign(static_cast<size_t>(std::accumulate(rc.begin(), rc.end(), int64_t(0))), -1);
  w.all_to_all(out.data(), sc.data(), in.data(), rc.data()).wait();
  ok = true;
  size_t at = 0;
  for (int q = 0; q < N; ++q)
    for (int i = 0; i < rc[q]; ++i) ok &= in[at++] == 1000 * q + 10 * R + i;
  expect(ok, "all_to_all with uneven counts");

  // broadcast from the last rank.
  std::vector<int64_t> b(5, R == N - 1 ? 42 : 0);
  w.broadcast(b.data(), 5, N - 1).wait();
  expect(b == std::vector<int64_t>(5, 42), "broadcast from the last rank");

  // Many in flight, waited in reverse order.
  std::vector<std::vector<float>> bufs(8, std::vector<float>(1000));
  std::vector<dist::Handle> hs;
  for (int k = 0; k < 8; ++k) {
    std::fill(bufs[k].begin(), bufs[k].end(), float(k + R));
    hs.push_back(w.all_reduce(bufs[k].data(), 1000));
  }
  for (int k = 7; k >= 0; --k) hs[k].wait();
  ok = true;
  for (int k = 0; k < 8; ++k) ok &= bufs[k][999] == float(N * k + N * (N - 1) / 2);
  expect(ok, "eight all_reduces in flight");

  // Progress while computing: the operation completes with no wait() called.
  std::vector<float> g(1 << 18, 1.0f);
  auto h = w.all_reduce(g.data(), static_cast<int64_t>(g.size()));
  const auto t0 = std::chrono::steady_clock::now();
  volatile double sink = 0;
  while (!h.done() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
    for (int i = 0; i < 100000; ++i) sink = sink + std::sqrt(double(i));
  expect(h.done(), "an all_reduce completes while the caller computes (no wait)");
  h.wait();
  expect(g[12345] == float(N), "the overlapped all_reduce's result");

  // split: even and odd ranks.
  auto half = w.split(R % 2, R);
  expect(half->size() == (N + 1 - R % 2) / 2 && half->rank() == R / 2, "split sizes and ranks");
  int64_t one = 1;
  half->all_reduce(&one, 1).wait();
  expect(one == half->size(), "all_reduce within a split");

  // The mesh: data=2 x fsdp=N/2 when N is even.
  if (N % 2 == 0) {
    dist::MeshConfig mc;
    mc.set("ici_data_parallelism", 2);
    dist::Mesh mesh(w, mc, N);
    expect(mesh.size(dist::kData) == 2 && mesh.size(dist::kFsdp) == N / 2, "mesh sizes " + mesh.describe());
    expect(mesh.coord(dist::kData) == R / (N / 2) && mesh.coord(dist::kFsdp) == R % (N / 2), "mesh coordinates");
    int64_t v = R;
    mesh.axis(dist::kFsdp).all_reduce(&v, 1).wait();
    // The fsdp group of rank R: the ranks with the same data coordinate.
    const int64_t base = (R / (N / 2)) * (N / 2);
    int64_t want = 0;
    for (int64_t r = base; r < base + N / 2; ++r) want += r;
    expect(v == want, "all_reduce over the fsdp axis");
    int64_t u = R;
    mesh.axis(dist::kData).all_reduce(&u, 1).wait();
    expect(u == 2 * (R % (N / 2)) + N / 2, "all_reduce over the data axis");
  }
  w.barrier().wait();
}

// FsdpParams over a mesh of data x fsdp x expert.
void sharded(int64_t data, int64_t fsdp, int64_t expert, const std::string& tiny) {
  dist::Communicator& w = dist::world();
  const std::string what = fmt::format("sharded data={} fsdp={} expert={}: ", data, fsdp, expert);
  dist::MeshConfig mc;
  mc.set("ici_data_parallelism", data);
  mc.set("ici_fsdp_parallelism", fsdp);
  mc.set("ici_expert_parallelism", expert);
  dist::Mesh mesh(w, mc, w.size());
  const auto rc = train::parse_run_config(tiny, {"mtp_num_layers=1"}, "check");
  const auto& cfg = rc.model;
  const int64_t mtp = cfg.num_nextn_predict_layers, E = cfg.n_routed_experts;
  const int64_t P = model::FlatParams::numel(cfg, mtp);
  std::vector<float> full(static_cast<size_t>(P));
  for (int64_t i = 0; i < P; ++i) full[i] = 1.0f + static_cast<float>(i % 9973) * 0.25f;
  dist::FsdpParams fp(cfg, mtp, mesh.shard_group(), mesh.axis(dist::kFsdp),
                      expert > 1 ? &mesh.axis(dist::kExpert) : nullptr);

  // Every element owned by exactly one rank of the shard group.
  std::vector<int64_t> cover(static_cast<size_t>(P), 0);
  for (const auto& pc : fp.owned())
    for (int64_t i = pc.lo; i < pc.hi; ++i) ++cover[i];
  mesh.shard_group().all_reduce(cover.data(), P).wait();
  expect(std::all_of(cover.begin(), cover.end(), [](int64_t c) { return c == 1; }), what + "shards tile the model");

  fp.take_shard(full.data(), fp.shard.data());
  std::vector<float> back(static_cast<size_t>(P), -1.0f);
  fp.gather_full(fp.shard.data(), back.data());
  expect(back == full, what + "take_shard then gather_full is the whole buffer");

  // The streamed layers: dense tensors and this rank's experts hold their
  // values, the other experts are absent.
  const int64_t units = cfg.num_hidden_layers + mtp, per = E / expert, mine = mesh.coord(dist::kExpert) * per;
  fp.start_step();
  fp.begin(units, false);
  int64_t off = 0, seen_mine = 0, seen_null = 0, bad = 0;
  std::vector<model::ParamInfo> infos = model::param_infos(cfg, mtp);
  std::vector<int64_t> offsets;
  for (const auto& i : infos) {
    offsets.push_back(off);
    off += i.numel();
  }
  for (int64_t u = 0; u < units; ++u) {
    fp.acquire(u, false);
    size_t k = 0;
    model::for_each_param(
        cfg, mtp,
        [&](const model::ParamInfo& i, const ops::WeightView& v) {
          const size_t t = k++;
          if (i.layer != u) return;
          const auto at = i.name.find(".mlp.experts.");
          if (expert > 1 && at != std::string::npos) {
            const int64_t e = std::stoll(i.name.substr(at + 13));
            if (e < mine || e >= mine + per) {
              seen_null += v.data == nullptr;
              bad += v.data != nullptr;
              return;
            }
            ++seen_mine;
          }
          const auto* p = static_cast<const float*>(v.data);
          if (!p || !std::equal(p, p + i.numel(), full.data() + offsets[t])) ++bad;
        },
        fp.view);
    fp.release(u, false);
  }
  expect(bad == 0, what + fmt::format("{} streamed tensors with wrong values or presence", bad));
  int64_t moe = 0;
  for (int64_t l = 0; l < units; ++l) moe += cfg.is_moe_layer(l);
  expect(expert == 1 || (seen_mine == 3 * per * moe && seen_null == 3 * (E - per) * moe),
         what + fmt::format("{} of this rank's expert tensors and {} absent ones", seen_mine, seen_null));

  // What a rank holds falls with the expert axis at the same shard-group size.
  if (expert > 1) {
    dist::MeshConfig flat;
    flat.set("ici_data_parallelism", data);
    flat.set("ici_fsdp_parallelism", fsdp * expert);
    flat.set("ici_expert_parallelism", 1);
    dist::Mesh m1(w, flat, w.size());
    dist::FsdpParams no_ep(cfg, mtp, m1.shard_group(), m1.axis(dist::kFsdp), nullptr);
    expect(
        fp.floats_held() < no_ep.floats_held(),
        what + fmt::format("holds {} floats, fsdp={} alone {}", fp.floats_held(), fsdp * expert, no_ep.floats_held()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    run();
    const int N = ds::dist::world().size();
    if (argc > 1) {
      const std::string tiny = "model_name: " + std::string(argv[1]) + "/configs/tiny.yml\nmax_target_length: 8\n";
      if (N == 2) sharded(1, 1, 2, tiny);
      if (N == 4) {
        sharded(1, 2, 2, tiny);
        sharded(2, 1, 2, tiny);
        sharded(1, 1, 4, tiny);
      }
    }
  } catch (const ds::Error& e) {
    fmt::print(stderr, "rank {}: error: {}\n", ds::dist::world().rank(), e.what());
    ds::dist::exit_after_error(1);
  }
  if (failures) ds::dist::exit_after_error(1);
  if (ds::dist::world().rank() == 0) fmt::print("dist check passed on {} ranks\n", ds::dist::world().size());
  return 0;
}
