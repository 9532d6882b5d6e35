// GEMM throughput: the engine's matmul against the raw BLAS calls it could be
// (OpenBLAS cblas_sgemm, oneDNN dnnl_sgemm), and the grouped (expert) matmul
// against one dense product of the same FLOPs.
//
//   OMP_NUM_THREADS=2 build/bench/matmul_bench --benchmark_min_time=0.2
//
// Every benchmark reports GFLOP/s (2 M N K per product; backward counts both
// products). The context block names the OpenBLAS kernel set picked at run
// time: a generic fallback there explains a slow OpenBLAS baseline.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <dnnl.h>

#include <numeric>
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "ops/grouped_matmul.h"
#include "ops/matmul.h"

namespace {

// c [M, N] = a [M, K] op(b), op(b) [K, N]; b is [N, K] when trans_b (a Hugging
// Face Linear weight).
struct Dense {
  int64_t M, N, K;
  bool trans_b;
};

struct Buffers {
  std::vector<float> a, b, c;
  explicit Buffers(const Dense& s) : a(s.M * s.K), b(s.K * s.N), c(s.M * s.N) {
    ds::fill_normal(a.data(), a.size(), 1.0f, 1);
    ds::fill_normal(b.data(), b.size(), 1.0f, 2);
  }
};

void set_rate(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Ours(benchmark::State& state, Dense s) {
  Buffers x(s);
  for (auto _ : state) {
    ds::ops::matmul_forward(x.c.data(), x.a.data(), x.b.data(), s.M, s.N, s.K, false, s.trans_b);
    benchmark::DoNotOptimize(x.c.data());
  }
  set_rate(state, 2.0 * s.M * s.N * s.K);
}

void BM_Cblas(benchmark::State& state, Dense s) {
  Buffers x(s);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, s.trans_b ? CblasTrans : CblasNoTrans, s.M, s.N, s.K, 1.0f, x.a.data(),
                s.K, x.b.data(), s.trans_b ? s.K : s.N, 0.0f, x.c.data(), s.N);
    benchmark::DoNotOptimize(x.c.data());
  }
  set_rate(state, 2.0 * s.M * s.N * s.K);
}

void BM_Dnnl(benchmark::State& state, Dense s) {
  Buffers x(s);
  for (auto _ : state) {
    dnnl_sgemm('N', s.trans_b ? 'T' : 'N', s.M, s.N, s.K, 1.0f, x.a.data(), s.K, x.b.data(), s.trans_b ? s.K : s.N,
               0.0f, x.c.data(), s.N);
    benchmark::DoNotOptimize(x.c.data());
  }
  set_rate(state, 2.0 * s.M * s.N * s.K);
}

// Dense backward (da and db) of the same shape: the baseline for the grouped
// backward.
void BM_OursBackward(benchmark::State& state, Dense s) {
  Buffers x(s);
  std::vector<float> da(s.M * s.K), db(s.K * s.N);
  for (auto _ : state) {
    ds::ops::matmul_backward(da.data(), db.data(), x.c.data(), x.a.data(), x.b.data(), s.M, s.N, s.K, false, s.trans_b);
    benchmark::DoNotOptimize(db.data());
  }
  set_rate(state, 4.0 * s.M * s.N * s.K);
}

// out [M, N] = lhs [M, K] rhs[g] for the rows of each group g.
struct Grouped {
  std::vector<int32_t> sizes;
  int64_t K, N;
  bool trans_rhs;
  int64_t M() const { return std::accumulate(sizes.begin(), sizes.end(), int64_t{0}); }
};

void BM_Grouped(benchmark::State& state, Grouped s, bool backward) {
  const int64_t G = s.sizes.size(), M = s.M(), K = s.K, N = s.N;
  std::vector<float> lhs(M * K), rhs(G * K * N), out(M * N), dlhs(M * K), drhs(G * K * N);
  ds::fill_normal(lhs.data(), lhs.size(), 1.0f, 3);
  ds::fill_normal(rhs.data(), rhs.size(), 1.0f, 4);
  ds::fill_normal(out.data(), out.size(), 1.0f, 5);
  for (auto _ : state) {
    if (backward)
      ds::ops::grouped_matmul_backward(dlhs.data(), drhs.data(), out.data(), lhs.data(), rhs.data(), s.sizes.data(), G,
                                       M, K, N, s.trans_rhs);
    else
      ds::ops::grouped_matmul_forward(out.data(), lhs.data(), rhs.data(), s.sizes.data(), G, M, K, N, s.trans_rhs);
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(drhs.data());
  }
  set_rate(state, (backward ? 4.0 : 2.0) * M * N * K);
}

std::string dense_name(const Dense& s) {
  return std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) + (s.trans_b ? "/trans_b" : "");
}

void register_all() {
  // Square products, projections of a 512- or 256-token batch (M tokens, K
  // in, N out; weights stored [out, in] as trans_b), and one decode token
  // (a memory-bound matrix-vector product).
  const Dense dense[] = {
      {1024, 1024, 1024, false}, {2048, 2048, 2048, false}, {512, 1408, 2048, true}, {512, 2048, 1408, true},
      {256, 2048, 7168, true},   {2048, 1024, 512, false},  {1, 2048, 7168, true},
  };
  for (const Dense& s : dense) {
    const std::string n = dense_name(s);
    benchmark::RegisterBenchmark(("matmul/ours/" + n).c_str(), BM_Ours, s)->UseRealTime();
    benchmark::RegisterBenchmark(("matmul/dnnl_sgemm/" + n).c_str(), BM_Dnnl, s)->UseRealTime();
  }

  // Experts: 16 groups of 2048 routed rows, evenly or unevenly spread (two
  // experts get nothing), against one product with M = all rows.
  const std::vector<int32_t> even(16, 128);
  const std::vector<int32_t> uneven = {512, 320, 256, 192, 160, 128, 96, 96, 64, 64, 48, 48, 32, 32, 0, 0};
  const std::vector<int32_t> small(16, 64);  // 1024 rows
  const std::vector<int32_t> large(16, 256);
  struct Case {
    const char* name;
    Grouped g;
  };
  const Case cases[] = {
      {"16x128", {even, 512, 1024, false}},
      {"16x128/trans_rhs", {even, 512, 1024, true}},
      {"16_uneven", {uneven, 512, 1024, false}},
      {"16_uneven/trans_rhs", {uneven, 512, 1024, true}},
      {"16x64_K2048_N1408", {small, 2048, 1408, false}},
      {"16x64_K2048_N1408/trans_rhs", {small, 2048, 1408, true}},
      {"16x256_K1408_N2048/trans_rhs", {large, 1408, 2048, true}},
      {"16x128_K256_N128", {even, 256, 128, false}},
  };
  for (const Case& c : cases) {
    const Dense same{c.g.M(), c.g.N, c.g.K, c.g.trans_rhs};
    const std::string d = dense_name(same);
    benchmark::RegisterBenchmark(("grouped/fwd/" + std::string(c.name)).c_str(), BM_Grouped, c.g, false)->UseRealTime();
    benchmark::RegisterBenchmark(("grouped/fwd_baseline/" + d).c_str(), BM_Ours, same)->UseRealTime();
    benchmark::RegisterBenchmark(("grouped/bwd/" + std::string(c.name)).c_str(), BM_Grouped, c.g, true)->UseRealTime();
    benchmark::RegisterBenchmark(("grouped/bwd_baseline/" + d).c_str(), BM_OursBackward, same)->UseRealTime();
  }

  // OpenBLAS last: its worker threads keep spinning for a while after each
  // call and would steal the cores from whatever OpenMP code runs next.
  for (const Dense& s : dense)
    benchmark::RegisterBenchmark(("matmul/cblas_sgemm/" + dense_name(s)).c_str(), BM_Cblas, s)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
