// Every collective of the MPI communicator against values each rank can
// predict, run by dist_mpi_test.sh under `mpirun -np 1|2|4`: sums and maxima
// of several element types (one buffer large enough for a multi-megabyte
// transfer), all_gather in place and not, reduce_scatter, all_to_all with
// uneven counts, broadcast from the last rank, many operations in flight at
// once waited in reverse order, an operation that completes while the caller
// computes (the progress thread at work, no wait called), split, and the
// mesh's axis communicators. Exits 1 with one line on the first mismatch.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/mesh.h"

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

}  // namespace

int main() {
  try {
    run();
  } catch (const ds::Error& e) {
    fmt::print(stderr, "rank {}: error: {}\n", ds::dist::world().rank(), e.what());
    ds::dist::exit_after_error(1);
  }
  if (failures) ds::dist::exit_after_error(1);
  if (ds::dist::world().rank() == 0) fmt::print("dist check passed on {} ranks\n", ds::dist::world().size());
  return 0;
}
