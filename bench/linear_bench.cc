// Linear layers over bf16, fp8 and fp4 weights (the checkpoint dtypes the
// engine keeps in memory; fp4 as DeepSeek-V4's experts) against dnnl_sgemm over the same weights already widened
// to float32 (what a float32 framework multiplies), for the projection shapes
// of the `small` preset and a few larger ones: M rows of activations, N out,
// K in.
//
//   OMP_NUM_THREADS=2 build/bench/linear_bench --benchmark_min_time=0.3
//
// DEEPSEEK_MAX_CPU_ISA (avx2, scalar, ...) caps the SIMD target the kernels
// run. GFLOP/s counts 2 M N K; weight_GB/s the weight's bytes (with fp4's
// scale bytes). The linear/bf16_bf16x, fp8_bf16x and fp4_bf16x rows run
// those weights in the bf16 matmul precision (x rounded to bf16;
// AVX512-BF16's dot products where the CPU has them, which
// DEEPSEEK_MAX_CPU_ISA=avx512 turns off).
// The cold_weights rows multiply a pool of weights far larger than the
// caches, a different one each time (as a prefill meets its experts); the
// widen rows time the prefill kernel's bf16 widening with its chunk in
// cache and from memory. The stream_rows rows (BM_StreamRows) read one
// weight far larger than the caches in bf16, q8_0, q4_k and q6_k (x rounded
// to 8 bits, and as float32: q8_0_f32x, q4_k_f32x) and fp4: the share of
// the memory bandwidth each format's decode kernel reaches.
#include <benchmark/benchmark.h>
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/block_quant.h"
#include "ops/linear.h"

namespace {

struct Shape {
  int64_t M, N, K;
  const char* what;
};

struct Operands {
  std::vector<float> x, w32, y;
  std::vector<uint16_t> w16;
  std::vector<uint8_t> w8;          // fp8 e4m3 with 128 x 128 block scales
  std::vector<float> w8_scale_inv;  // (DeepSeek-V3's checkpoint format)
  std::vector<uint8_t> w4, w4_scale;  // fp4 e2m1 pairs, an e8m0 scale per 32
  explicit Operands(const Shape& s)
      : x(s.M * s.K), w32(s.N * s.K), y(s.M * s.N), w16(s.N * s.K), w8(s.N * s.K), w4(s.N * s.K / 2),
        w4_scale(s.N * s.K / 32) {
    for (size_t i = 0; i < w4.size(); ++i) w4[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
    for (size_t i = 0; i < w4_scale.size(); ++i) w4_scale[i] = static_cast<uint8_t>(118 + i % 4);
    ds::fill_normal(x.data(), x.size(), 1.0f, 1);
    ds::fill_normal(w32.data(), w32.size(), 0.05f, 2);
    w8_scale_inv.resize(((s.N + 127) / 128) * ((s.K + 127) / 128));
    ds::ops::quantize_fp8_blocks(w8.data(), w8_scale_inv.data(), w32.data(), s.N, s.K);
    ds::convert(w16.data(), ds::DType::BF16, w32.data(), ds::DType::F32, w32.size());
    ds::convert(w32.data(), ds::DType::F32, w16.data(), ds::DType::BF16, w16.size());  // same values
  }
};

void set_rate(benchmark::State& state, const Shape& s) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * s.M * s.N * s.K * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The weight as a checkpoint stores it: bf16, or fp8 e4m3 with 128 x 128
// block scales.
void BM_Linear(benchmark::State& state, Shape s, ds::DType dt, ds::ops::MatmulPrecision precision) {
  Operands o(s);
  ds::ops::set_matmul_precision(precision);
  const bool fp8 = dt == ds::DType::F8E4M3, fp4 = dt == ds::DType::F4E2M1;
  const void* data = fp8 ? static_cast<const void*>(o.w8.data())
                   : fp4 ? static_cast<const void*>(o.w4.data())
                         : static_cast<const void*>(o.w16.data());
  const ds::ops::WeightView w{
      data, dt, s.N, s.K, fp8 ? o.w8_scale_inv.data() : nullptr, 128, 128, fp4 ? o.w4_scale.data() : nullptr};
  for (auto _ : state) {
    ds::ops::linear_forward(o.y.data(), o.x.data(), w, s.M);
    benchmark::DoNotOptimize(o.y.data());
  }
  ds::ops::set_matmul_precision(ds::ops::MatmulPrecision::kF32);
  set_rate(state, s);
  const double bytes = fp4 ? static_cast<double>(o.w4.size() + o.w4_scale.size())
                           : static_cast<double>(s.N * s.K * ds::dtype_size(dt));
  state.counters["weight_GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// A pool of expert-sized weights far larger than the caches (at least 128
// MiB), taken in turn as a prefill's expert tasks take them: every thread
// multiplies its own M rows by one weight after another, the next weight
// never in cache. The engine's prefill at batch 1 meets its experts so
// (about 32 tokens each, one task per expert and thread).
void BM_LinearColdWeights(benchmark::State& state, Shape s, ds::DType dt, ds::ops::MatmulPrecision precision) {
  Operands o(s);
  ds::ops::set_matmul_precision(precision);
  const bool fp8 = dt == ds::DType::F8E4M3;
  const size_t bytes = static_cast<size_t>(s.N * s.K) * ds::dtype_size(dt);
  const int64_t count = std::max<int64_t>(8, static_cast<int64_t>((size_t{128} << 20) / bytes));
  std::vector<uint8_t> pool(bytes * static_cast<size_t>(count));
  const void* one = fp8 ? static_cast<const void*>(o.w8.data()) : static_cast<const void*>(o.w16.data());
  for (int64_t i = 0; i < count; ++i) std::memcpy(pool.data() + i * bytes, one, bytes);
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> y(static_cast<size_t>(threads), std::vector<float>(o.y.size()));
  int64_t next = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      for (int j = 0; j < 4; ++j) {  // four weights per thread and iteration
        const int64_t i = (next + 4 * t + j) % count;
        const ds::ops::WeightView w{pool.data() + i * bytes, dt, s.N, s.K, fp8 ? o.w8_scale_inv.data() : nullptr,
                                    128, 128, nullptr};
        ds::ops::linear_forward(y[t].data(), o.x.data(), w, s.M);
      }
    }
    next = (next + 4 * threads) % count;
    benchmark::DoNotOptimize(y.data());
  }
  ds::ops::set_matmul_precision(ds::ops::MatmulPrecision::kF32);
  const double per_iteration = 4.0 * threads;
  state.counters["GFLOP/s"] = benchmark::Counter(per_iteration * 2.0 * s.M * s.N * s.K * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] = benchmark::Counter(per_iteration * static_cast<double>(bytes) * 1e-9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

// widen_rows (bf16 to float32) of a 96 x 384 chunk, one thread: the same
// chunk again and again (in cache), or each time the next of a 128 MiB
// pool (from memory), the prefill kernel's widening with and without the
// weight in cache.
void BM_WidenBf16(benchmark::State& state, bool from_memory) {
  constexpr int64_t kRows = 96, kCols = 384;
  const size_t chunk = static_cast<size_t>(kRows * kCols);
  const size_t count = from_memory ? (size_t{64} << 20) / chunk : 1;  // bf16 elements: 128 MiB
  std::vector<uint16_t> pool(chunk * count, 0x3f80);                  // 1.0
  std::vector<float> out(chunk);
  size_t i = 0;
  for (auto _ : state) {
    const ds::ops::WeightView w{pool.data() + i * chunk, ds::DType::BF16, kRows, kCols};
    ds::ops::widen_rows(out.data(), w, 0, kRows);
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % count;
  }
  state.counters["bf16_GB/s"] =
      benchmark::Counter(static_cast<double>(chunk * 2) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_SgemmF32(benchmark::State& state, Shape s) {
  Operands o(s);
  for (auto _ : state) {
    dnnl_sgemm('N', 'T', s.M, s.N, s.K, 1.0f, o.x.data(), s.K, o.w32.data(), s.K, 0.0f, o.y.data(), s.N);
    benchmark::DoNotOptimize(o.y.data());
  }
  set_rate(state, s);
}

// Decode (M rows of x) over one weight of 65536 x 4096 in each format the
// engine streams: 512 MiB as bf16, 272 as q8_0, 144 as q4_k, 136 as fp4
// with its scales, all several times the caches (the whole weight is read
// each time). weight_GB/s against peak_bench's read bandwidth is the share of it
// each format's kernel reaches. The rows are 64 distinct quantized rows
// (fp4: random codes, scales near 1) repeated.
void BM_StreamRows(benchmark::State& state, ds::DType dt, int64_t M, ds::ops::QuantizedX qx) {
  constexpr int64_t N = 65536, K = 4096, kDistinct = 64;
  std::vector<float> w32(static_cast<size_t>(kDistinct * K)), x(static_cast<size_t>(M * K)),
      y(static_cast<size_t>(M * N));
  ds::fill_normal(w32.data(), w32.size(), 0.05f, 2);
  ds::fill_normal(x.data(), x.size(), 1.0f, 1);
  const bool fp4 = dt == ds::DType::F4E2M1;
  const int64_t row_bytes = fp4                            ? K / 2
                            : ds::ops::is_block_format(dt) ? ds::ops::block_row_bytes(dt, K)
                                                           : K * static_cast<int64_t>(ds::dtype_size(dt));
  std::vector<uint8_t> pattern(static_cast<size_t>(kDistinct * row_bytes));
  if (fp4) {
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  } else if (ds::ops::is_block_format(dt)) {
    ds::ops::quantize_rows(dt, w32.data(), kDistinct, K, pattern.data());
  } else {
    ds::convert(pattern.data(), dt, w32.data(), ds::DType::F32, w32.size());
  }
  std::vector<uint8_t> w(static_cast<size_t>(N * row_bytes));
  for (int64_t r = 0; r < N; r += kDistinct) std::memcpy(w.data() + r * row_bytes, pattern.data(), pattern.size());
  std::vector<uint8_t> scales(fp4 ? static_cast<size_t>(N * K / 32) : 0);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<uint8_t>(126 + i % 3);
  const ds::ops::WeightView view{w.data(), dt, N, K, nullptr, 128, 128, fp4 ? scales.data() : nullptr};
  ds::ops::set_quantized_x(qx);
  for (auto _ : state) {
    ds::ops::linear_forward(y.data(), x.data(), view, M);
    benchmark::DoNotOptimize(y.data());
  }
  ds::ops::set_quantized_x(ds::ops::QuantizedX::kInt8);
  state.counters["weight_GB/s"] = benchmark::Counter(static_cast<double>(w.size() + scales.size()) * 1e-9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  for (const int64_t M : {1, 8}) {
    const auto int8 = ds::ops::QuantizedX::kInt8, f32 = ds::ops::QuantizedX::kF32;
    const std::string m = "/M" + std::to_string(M);
    benchmark::RegisterBenchmark(("stream_rows/bf16" + m).c_str(), BM_StreamRows, ds::DType::BF16, M, f32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/q8_0" + m).c_str(), BM_StreamRows, ds::DType::Q8_0, M, int8)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/q8_0_f32x" + m).c_str(), BM_StreamRows, ds::DType::Q8_0, M, f32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/q4_k" + m).c_str(), BM_StreamRows, ds::DType::Q4_K, M, int8)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/q4_k_f32x" + m).c_str(), BM_StreamRows, ds::DType::Q4_K, M, f32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/q6_k" + m).c_str(), BM_StreamRows, ds::DType::Q6_K, M, int8)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("stream_rows/fp4" + m).c_str(), BM_StreamRows, ds::DType::F4E2M1, M, f32)
        ->UseRealTime();
  }
  const Shape shapes[] = {
      {32, 256, 384, "expert_gate_prefill_b1"},
      {32, 384, 256, "expert_down_prefill_b1"},
      {128, 288, 192, "q_b_prefill_b1"},
      {128, 1024, 384, "dense_gate_prefill_b1"},
      {256, 256, 384, "expert_gate_prefill_b8"},
      {1024, 1024, 384, "dense_gate_prefill_b8"},
      {8, 1024, 384, "dense_gate_decode_b8"},
      {1, 1024, 384, "dense_gate_decode_b1"},
      // DeepSeek-V2-Lite-sized projections (hidden 2048, expert width 1408).
      {256, 1408, 2048, "v2lite_expert_prefill"},
      {512, 2048, 1408, "v2lite_expert_down_prefill"},
      // A 64 MiB weight, far beyond the caches: decode streams it from memory.
      {8, 16384, 2048, "stream_decode_b8"},
      {1, 16384, 2048, "stream_decode_b1"},
      // Rows as short as the `small` preset's experts' (384 columns), 48 MiB
      // of them as bf16: a decode step's experts, each met by one or two
      // tokens, as one weight.
      {2, 65536, 384, "expert_rows_stream_decode"},
  };
  for (const Shape& s : shapes) {
    const std::string n =
        std::string(s.what) + "/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
    const auto f32 = ds::ops::MatmulPrecision::kF32;
    benchmark::RegisterBenchmark(("linear/bf16/" + n).c_str(), BM_Linear, s, ds::DType::BF16, f32)->UseRealTime();
    benchmark::RegisterBenchmark(("linear/bf16_bf16x/" + n).c_str(), BM_Linear, s, ds::DType::BF16,
                                 ds::ops::MatmulPrecision::kBf16)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("linear/fp8/" + n).c_str(), BM_Linear, s, ds::DType::F8E4M3, f32)->UseRealTime();
    benchmark::RegisterBenchmark(("linear/fp8_bf16x/" + n).c_str(), BM_Linear, s, ds::DType::F8E4M3,
                                 ds::ops::MatmulPrecision::kBf16)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("linear/fp4/" + n).c_str(), BM_Linear, s, ds::DType::F4E2M1, f32)->UseRealTime();
    benchmark::RegisterBenchmark(("linear/fp4_bf16x/" + n).c_str(), BM_Linear, s, ds::DType::F4E2M1,
                                 ds::ops::MatmulPrecision::kBf16)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("dnnl_sgemm/f32/" + n).c_str(), BM_SgemmF32, s)->UseRealTime();
  }
  // The `small` preset's expert gate (or up) at batch 1, and DeepSeek-V3's.
  const Shape cold[] = {{32, 256, 384, "small_expert_gate_b1"}, {32, 2048, 7168, "v3_expert_gate_b1"}};
  for (const Shape& s : cold) {
    const std::string n = std::string(s.what) + "/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" +
                          std::to_string(s.K);
    const auto f32 = ds::ops::MatmulPrecision::kF32, bf16x = ds::ops::MatmulPrecision::kBf16;
    benchmark::RegisterBenchmark(("cold_weights/bf16/" + n).c_str(), BM_LinearColdWeights, s, ds::DType::BF16, f32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cold_weights/bf16_bf16x/" + n).c_str(), BM_LinearColdWeights, s, ds::DType::BF16,
                                 bf16x)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cold_weights/fp8/" + n).c_str(), BM_LinearColdWeights, s, ds::DType::F8E4M3, f32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cold_weights/fp8_bf16x/" + n).c_str(), BM_LinearColdWeights, s,
                                 ds::DType::F8E4M3, bf16x)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("widen/bf16/cached", BM_WidenBf16, false)->UseRealTime();
  benchmark::RegisterBenchmark("widen/bf16/memory", BM_WidenBf16, true)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
