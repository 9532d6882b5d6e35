// The float32 FMA ceiling of this CPU: a loop of independent fused
// multiply-adds at the widest SIMD target the kernels dispatch to, on one
// thread and on every OpenMP thread at once. Every throughput figure of the
// engine (GFLOP/s, MFU-like fractions in docs/performance.md) can be read
// against it; the sgemm rates of matmul_bench show how much of it a tuned
// BLAS reaches.
//
//   OMP_WAIT_POLICY=active build/bench/peak_bench --benchmark_min_time=0.5
//
// DEEPSEEK_MAX_CPU_ISA (avx2, ...) caps the target, as for the kernels.
// GFLOP/s counts 2 per lane per FMA. Where the CPU has AVX512-BF16 (and the
// cap allows it) the dot_peak/bf16 rows give the bf16 dot products' ceiling
// too, 4 FLOPs per float32 lane per instruction. read_bandwidth is the
// memory's read rate (GB/s, 1e9 bytes) with every thread streaming.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "peak_bench.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Twelve independent accumulators (more than FMA latency x FMA ports on
// current x86 and Arm cores), `iters` rounds of twelve FMAs each; ab holds
// a, b and the accumulators' starting values (14 floats). Returns
// the FLOPs done; *sink receives a value that depends on every accumulator
// so that none of the work can be dropped.
int64_t FmaLoop(int64_t iters, const float* ab, float* sink) {
  const hn::ScalableTag<float> d;
  // Distinct starting values: equal chains would be merged by the compiler.
  const auto a = hn::Set(d, ab[0]), b = hn::Set(d, ab[1]);
  auto c0 = hn::Set(d, ab[2]), c1 = hn::Set(d, ab[3]), c2 = hn::Set(d, ab[4]), c3 = hn::Set(d, ab[5]);
  auto c4 = hn::Set(d, ab[6]), c5 = hn::Set(d, ab[7]), c6 = hn::Set(d, ab[8]), c7 = hn::Set(d, ab[9]);
  auto c8 = hn::Set(d, ab[10]), c9 = hn::Set(d, ab[11]), c10 = hn::Set(d, ab[12]), c11 = hn::Set(d, ab[13]);
#define DS_PEAK_FMA(i) c##i = hn::MulAdd(c##i, a, b);
  for (int64_t i = 0; i < iters; ++i) {
    // clang-format off
    DS_PEAK_FMA(0) DS_PEAK_FMA(1) DS_PEAK_FMA(2) DS_PEAK_FMA(3) DS_PEAK_FMA(4) DS_PEAK_FMA(5)
    DS_PEAK_FMA(6) DS_PEAK_FMA(7) DS_PEAK_FMA(8) DS_PEAK_FMA(9) DS_PEAK_FMA(10) DS_PEAK_FMA(11)
    // clang-format on
  }
#undef DS_PEAK_FMA
  const auto s = hn::Add(hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)), hn::Add(hn::Add(c4, c5), hn::Add(c6, c7))),
                         hn::Add(hn::Add(c8, c9), hn::Add(c10, c11)));
  *sink = hn::GetLane(hn::SumOfLanes(d, s));
  return iters * 12 * static_cast<int64_t>(hn::Lanes(d)) * 2;
}

// The bf16 dot-product ceiling (AVX512-BF16's vdpbf16ps, which the bf16
// matmul precision's prefill tiles run): twelve independent accumulators,
// each instruction 2 products of a bf16 pair per float32 lane (4 FLOPs per
// lane). Returns 0 on every other target (no such instruction here).
#if HWY_TARGET == HWY_AVX3
__attribute__((target(HWY_TARGET_STR ",avx512bf16"))) int64_t Bf16DotLoop(int64_t iters, const float* ab,
                                                                          float* sink) {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(ab[0]), _mm512_set1_ps(ab[0]));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(ab[1]), _mm512_set1_ps(ab[1]));
  __m512 c0 = _mm512_set1_ps(ab[2]), c1 = _mm512_set1_ps(ab[3]), c2 = _mm512_set1_ps(ab[4]);
  __m512 c3 = _mm512_set1_ps(ab[5]), c4 = _mm512_set1_ps(ab[6]), c5 = _mm512_set1_ps(ab[7]);
  __m512 c6 = _mm512_set1_ps(ab[8]), c7 = _mm512_set1_ps(ab[9]), c8 = _mm512_set1_ps(ab[10]);
  __m512 c9 = _mm512_set1_ps(ab[11]), c10 = _mm512_set1_ps(ab[12]), c11 = _mm512_set1_ps(ab[13]);
#define DS_PEAK_DOT(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
  for (int64_t i = 0; i < iters; ++i) {
    // clang-format off
    DS_PEAK_DOT(0) DS_PEAK_DOT(1) DS_PEAK_DOT(2) DS_PEAK_DOT(3) DS_PEAK_DOT(4) DS_PEAK_DOT(5)
    DS_PEAK_DOT(6) DS_PEAK_DOT(7) DS_PEAK_DOT(8) DS_PEAK_DOT(9) DS_PEAK_DOT(10) DS_PEAK_DOT(11)
    // clang-format on
  }
#undef DS_PEAK_DOT
  const __m512 s = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                    _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
      _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  *sink = _mm512_reduce_add_ps(s);
  return iters * 12 * 16 * 4;
}
#else
int64_t Bf16DotLoop(int64_t, const float*, float*) { return 0; }
#endif

// Sums n floats at p with four independent vector accumulators: a read
// stream at the widest target (what decode's weight streaming can reach).
float SumStream(const float* HWY_RESTRICT p, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    s0 = hn::Add(s0, hn::LoadU(d, p + i));
    s1 = hn::Add(s1, hn::LoadU(d, p + i + N));
    s2 = hn::Add(s2, hn::LoadU(d, p + i + 2 * N));
    s3 = hn::Add(s3, hn::LoadU(d, p + i + 3 * N));
  }
  float t = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) t += p[i];
  return t;
}

}  // namespace ds::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <benchmark/benchmark.h>
#include <omp.h>

#include <atomic>
#include <vector>

#include "bench_main.h"
#include "core/simd.h"

namespace ds::bench {
HWY_EXPORT(FmaLoop);
HWY_EXPORT(Bf16DotLoop);
HWY_EXPORT(SumStream);

namespace {

// Rounds per call: about a millisecond on a current core.
constexpr int64_t kIters = 1 << 18;

// a, b, then the twelve accumulators' starting values: a * c + b stays
// finite for any number of rounds (|a| < 1).
float* operands() {
  static float ab[14] = {0.5f, 0.25f, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  benchmark::DoNotOptimize(ab);
  return ab;
}

// kIters rounds of the FMA loop, or of the bf16 dot-product one; the FLOPs
// done (0: no dot products on this target).
int64_t run_loop(bool dot, float* sink) {
  return dot ? DS_DISPATCH(Bf16DotLoop)(kIters, operands(), sink) : DS_DISPATCH(FmaLoop)(kIters, operands(), sink);
}

void OneThread(benchmark::State& state, bool dot) {
  float sink = 0;
  int64_t flops = 0;
  for (auto _ : state) flops = run_loop(dot, &sink);
  benchmark::DoNotOptimize(sink);
  state.counters["GFLOP/s"] =
      benchmark::Counter(static_cast<double>(flops) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Every OpenMP thread running the loop at once.
void AllThreads(benchmark::State& state, bool dot) {
  const int threads = omp_get_max_threads();
  std::atomic<int64_t> flops{0};
  for (auto _ : state) {
#pragma omp parallel
    {
      float s = 0;
      flops.store(run_loop(dot, &s), std::memory_order_relaxed);
      benchmark::DoNotOptimize(s);
    }
  }
  state.counters["threads"] = threads;
  state.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(flops.load()) * threads * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s/thread"] =
      benchmark::Counter(static_cast<double>(flops.load()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Memory read bandwidth: every OpenMP thread summing its share of a 1 GiB
// buffer (far past the caches), each iteration reading all of it. The
// ceiling a decode step bound by streaming its weights is measured against.
void ReadBandwidth(benchmark::State& state) {
  const int64_t n = int64_t{1} << 28;  // floats: 1 GiB
  static std::vector<float> buf;
  if (buf.empty()) {
    buf.resize(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)  // first touch by the threads that read
    for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = static_cast<float>(i & 7);
  }
  float sink = 0;
  for (auto _ : state) {
#pragma omp parallel reduction(+ : sink)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t a = n * t / T, b = n * (t + 1) / T;
      sink += DS_DISPATCH(SumStream)(buf.data() + a, b - a);
    }
  }
  benchmark::DoNotOptimize(sink);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(n) * sizeof(float) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = omp_get_max_threads();
}

void register_all() {
  benchmark::RegisterBenchmark("read_bandwidth/all_threads", ReadBandwidth)->UseRealTime()->Iterations(8);
  benchmark::RegisterBenchmark("fma_peak/f32/one_thread", OneThread, false)->UseRealTime();
  benchmark::RegisterBenchmark("fma_peak/f32/all_threads", AllThreads, false)->UseRealTime();
  // The bf16 dot products, where the CPU has them and the cap allows them.
  float sink = 0;
  if (simd_bf16_dot_allowed() && DS_DISPATCH(Bf16DotLoop)(1, operands(), &sink) > 0) {
    benchmark::RegisterBenchmark("dot_peak/bf16/one_thread", OneThread, true)->UseRealTime();
    benchmark::RegisterBenchmark("dot_peak/bf16/all_threads", AllThreads, true)->UseRealTime();
  }
}

}  // namespace
}  // namespace ds::bench

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, ds::bench::register_all); }
#endif  // HWY_ONCE
