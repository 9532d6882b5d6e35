// Memory-bound row and elementwise ops: RMSNorm forward and backward, silu*mul
// and softmax, against the machine's copy bandwidth (memcpy of a buffer of the
// same size, one thread and split over the OpenMP threads, and a vectorized
// copy loop with ordinary stores).
//
//   OMP_NUM_THREADS=2 build/bench/rmsnorm_bench --benchmark_min_time=0.2
//
// Every benchmark reports GB/s of compulsory traffic: each input read once and
// each output written once (a copy counts its read and its write). Buffers are
// far larger than the caches, so that is the traffic to DRAM, except that
// ordinary stores also read each output line before writing it: ops and the
// scale copy move up to 1.5x the counted bytes, memcpy exactly them.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "ops/activations.h"
#include "ops/rmsnorm.h"

namespace {

std::vector<float> random(int64_t n, uint64_t seed) {
  std::vector<float> v(n);
  ds::fill_normal(v.data(), n, 1.0f, seed);
  return v;
}

void set_bandwidth(benchmark::State& state, double bytes_per_iter) {
  state.counters["GB/s"] = benchmark::Counter(bytes_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// y = rmsnorm(x): reads x and w, writes y and rstd.
void BM_RmsnormForward(benchmark::State& state, int64_t rows, int64_t dim) {
  const auto x = random(rows * dim, 1), w = random(dim, 2);
  std::vector<float> y(rows * dim), rstd(rows);
  for (auto _ : state) {
    ds::ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), rows, dim, 1e-6f);
    benchmark::DoNotOptimize(y.data());
  }
  set_bandwidth(state, 4.0 * (2 * rows * dim + dim + rows));
}

// dx and dw (+=): reads dy, x, w, rstd, writes dx, reads and writes dw.
void BM_RmsnormBackward(benchmark::State& state, int64_t rows, int64_t dim) {
  const auto x = random(rows * dim, 1), w = random(dim, 2), dy = random(rows * dim, 3);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim), dw(dim, 0.0f);
  ds::ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), rows, dim, 1e-6f);
  for (auto _ : state) {
    ds::ops::rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), rows, dim);
    benchmark::DoNotOptimize(dx.data());
  }
  set_bandwidth(state, 4.0 * (3 * rows * dim + 3 * dim + rows));
}

// out = silu(a) * b: reads a and b, writes out.
void BM_SiluMulForward(benchmark::State& state, int64_t n) {
  const auto a = random(n, 1), b = random(n, 2);
  std::vector<float> out(n);
  for (auto _ : state) {
    ds::ops::silu_mul_forward(out.data(), a.data(), b.data(), n);
    benchmark::DoNotOptimize(out.data());
  }
  set_bandwidth(state, 4.0 * 3 * n);
}

// da, db: reads dout, a and b, writes da and db.
void BM_SiluMulBackward(benchmark::State& state, int64_t n) {
  const auto a = random(n, 1), b = random(n, 2), g = random(n, 3);
  std::vector<float> da(n), db(n);
  for (auto _ : state) {
    ds::ops::silu_mul_backward(da.data(), db.data(), g.data(), a.data(), b.data(), n);
    benchmark::DoNotOptimize(da.data());
  }
  set_bandwidth(state, 4.0 * 5 * n);
}

// Row softmax: reads x, writes y.
void BM_SoftmaxForward(benchmark::State& state, int64_t rows, int64_t cols) {
  const auto x = random(rows * cols, 1);
  std::vector<float> y(rows * cols);
  for (auto _ : state) {
    ds::ops::softmax_forward(y.data(), x.data(), rows, cols);
    benchmark::DoNotOptimize(y.data());
  }
  set_bandwidth(state, 4.0 * 2 * rows * cols);
}

// dx = y (dy - sum(dy y)): reads dy and y, writes dx.
void BM_SoftmaxBackward(benchmark::State& state, int64_t rows, int64_t cols) {
  const auto x = random(rows * cols, 1), dy = random(rows * cols, 2);
  std::vector<float> y(rows * cols), dx(rows * cols);
  ds::ops::softmax_forward(y.data(), x.data(), rows, cols);
  for (auto _ : state) {
    ds::ops::softmax_backward(dx.data(), dy.data(), y.data(), rows, cols);
    benchmark::DoNotOptimize(dx.data());
  }
  set_bandwidth(state, 4.0 * 3 * rows * cols);
}

// memcpy of n floats, on the calling thread or split evenly over the OpenMP
// threads (the ops above use all of them): the bandwidth ceiling to compare with.
void BM_Memcpy(benchmark::State& state, int64_t n, bool parallel) {
  const auto src = random(n, 1);
  std::vector<float> dst(n);
  for (auto _ : state) {
    if (parallel) {
#pragma omp parallel
      {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        std::memcpy(dst.data() + lo, src.data() + lo, (hi - lo) * sizeof(float));
      }
    } else {
      std::memcpy(dst.data(), src.data(), n * sizeof(float));
    }
    benchmark::DoNotOptimize(dst.data());
  }
  set_bandwidth(state, 4.0 * 2 * n);
}

// dst = src * s as a vectorized loop over the OpenMP threads: the same copy
// with ordinary stores, which (unlike glibc's memcpy at these sizes, which
// streams past the cache) first read each destination line, as the ops do.
void BM_ScaleCopy(benchmark::State& state, int64_t n) {
  const auto src = random(n, 1);
  std::vector<float> dst(n);
  const float s = static_cast<float>(state.range(0) + 1);  // not a constant the compiler could fold
  for (auto _ : state) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
    benchmark::DoNotOptimize(dst.data());
  }
  set_bandwidth(state, 4.0 * 2 * n);
}

void register_all() {
  // DeepSeek-V3 shapes: hidden 7168 over a 4096-token batch; the 512-wide
  // kv_a_layernorm over 16384 tokens. Both are 29.4M and 8.4M floats per tensor.
  const std::pair<int64_t, int64_t> norms[] = {{4096, 7168}, {16384, 512}};
  for (const auto& [rows, dim] : norms) {
    const std::string s = std::to_string(rows) + "x" + std::to_string(dim);
    benchmark::RegisterBenchmark(("rmsnorm/fwd/" + s).c_str(), BM_RmsnormForward, rows, dim)->UseRealTime();
    benchmark::RegisterBenchmark(("rmsnorm/bwd/" + s).c_str(), BM_RmsnormBackward, rows, dim)->UseRealTime();
  }
  // The gated MLP of 4096 tokens through a 2048-wide expert projection, i.e.
  // 8.4M elements per tensor; and the same count as the large norm.
  for (int64_t n : {int64_t{4096} * 2048, int64_t{4096} * 7168}) {
    const std::string s = std::to_string(n);
    benchmark::RegisterBenchmark(("silu_mul/fwd/" + s).c_str(), BM_SiluMulForward, n)->UseRealTime();
    benchmark::RegisterBenchmark(("silu_mul/bwd/" + s).c_str(), BM_SiluMulBackward, n)->UseRealTime();
  }
  // Attention-score rows (4096 keys) and router rows (256 experts).
  const std::pair<int64_t, int64_t> soft[] = {{4096, 4096}, {65536, 256}};
  for (const auto& [rows, cols] : soft) {
    const std::string s = std::to_string(rows) + "x" + std::to_string(cols);
    benchmark::RegisterBenchmark(("softmax/fwd/" + s).c_str(), BM_SoftmaxForward, rows, cols)->UseRealTime();
    benchmark::RegisterBenchmark(("softmax/bwd/" + s).c_str(), BM_SoftmaxBackward, rows, cols)->UseRealTime();
  }
  for (int64_t n : {int64_t{4096} * 7168, int64_t{4096} * 2048}) {
    const std::string s = std::to_string(n);
    benchmark::RegisterBenchmark(("memcpy/1_thread/" + s).c_str(), BM_Memcpy, n, false)->UseRealTime();
    benchmark::RegisterBenchmark(("memcpy/omp_threads/" + s).c_str(), BM_Memcpy, n, true)->UseRealTime();
    benchmark::RegisterBenchmark(("scale_copy/omp_threads/" + s).c_str(), BM_ScaleCopy, n)->Arg(0)->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
