// DeepSeek-V4's compressor pooling (ops/compressor.h), forward and backward:
// the gated softmax pooling of every m tokens' projections into one entry.
//
//   OMP_NUM_THREADS=2 build/bench/compressor_bench --benchmark_min_time=0.3
//
// Shapes: the v4-tiny preset's (one 256-token sequence, 80-wide entries, the
// overlapping ratio-4 pooling and the plain ratio-16 one) and DeepSeek-V4's
// (4096 tokens, 512-wide entries, ratio 4 with overlap and ratio 128). Each
// reports the rate of P and Z elements pooled.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "ops/compressor.h"

namespace {

struct Shape {
  int64_t tokens, dim, ratio;
  bool overlap;
};

ds::ops::CompressorDims dims(const Shape& s) {
  ds::ops::CompressorDims d;
  d.tokens = s.tokens;
  d.dim = s.dim;
  d.ratio = s.ratio;
  d.overlap = s.overlap;
  return d;
}

void BM_Pool(benchmark::State& state, Shape s, bool backward) {
  const auto d = dims(s);
  const size_t n = static_cast<size_t>(d.tokens * d.width());
  std::vector<float> P(n), Z(n), dP(n), dZ(n), out(static_cast<size_t>(d.entries() * d.dim));
  ds::fill_normal(P.data(), n, 1.0f, 1);
  ds::fill_normal(Z.data(), n, 1.0f, 2);
  ds::fill_normal(out.data(), out.size(), 1.0f, 3);
  for (auto _ : state) {
    if (backward)
      ds::ops::compressor_pool_backward(dP.data(), dZ.data(), out.data(), P.data(), Z.data(), d);
    else
      ds::ops::compressor_pool_forward(out.data(), P.data(), Z.data(), d);
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(dP.data());
  }
  state.counters["Melem/s"] =
      benchmark::Counter(static_cast<double>(n) * 1e-6, benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  const Shape shapes[] = {{256, 80, 4, true}, {256, 80, 16, false}, {4096, 512, 4, true}, {4096, 512, 128, false}};
  for (const Shape& s : shapes) {
    const std::string n = std::to_string(s.tokens) + "x" + std::to_string(s.dim) + "/m" + std::to_string(s.ratio) +
                          (s.overlap ? "/overlap" : "");
    benchmark::RegisterBenchmark(("compressor/fwd/" + n).c_str(), BM_Pool, s, false)->UseRealTime();
    benchmark::RegisterBenchmark(("compressor/bwd/" + n).c_str(), BM_Pool, s, true)->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
