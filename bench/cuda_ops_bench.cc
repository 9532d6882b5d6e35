// The CUDA backend's ops on the GPU, through the backend table, against the
// GPU's own ceilings: its device-to-device copy bandwidth for the memory-bound
// ops and decode-sized products, and the bf16 matrix rate for prefill-sized
// products. bench/cuda_compare.py runs PyTorch eager on the same shapes in the
// same run and prints the ratio:
//
//   build/bench/cuda_ops_bench --benchmark_format=json > ours.json
//   python3 bench/cuda_compare.py ours.json
//
// Each benchmark iteration launches the op `kReps` times and waits once, so
// the time per op includes the host's launch cost but not one
// synchronization per op. Traffic counts each input read once and each output
// written once. Where the build or the machine has no CUDA backend every
// benchmark reports the reason as an error.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/backend.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"

namespace {

using ds::ops::Backend;
constexpr int kReps = 20;

const Backend* gpu(benchmark::State& state) {
  const Backend* b = ds::ops::cuda_backend();
  if (!b) state.SkipWithError(("no CUDA backend: " + ds::ops::cuda_status()).c_str());
  return b;
}

struct DeviceBuffer {
  const Backend* b;
  void* p;
  DeviceBuffer(const Backend* be, const void* host, size_t bytes) : b(be), p(be->alloc(bytes)) {
    if (host) b->upload(p, host, bytes);
  }
  ~DeviceBuffer() { b->free(p); }
  float* f() const { return static_cast<float*>(p); }
};

std::vector<float> random(int64_t n, uint64_t seed) {
  std::vector<float> v(n);
  ds::fill_normal(v.data(), n, 1.0f, seed);
  return v;
}

// Times `op` kReps times per iteration.
template <typename Op>
void run(benchmark::State& state, const Backend* b, Op op) {
  op();
  b->synchronize();
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kReps; ++i) op();
    b->synchronize();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kReps);
  }
}

void counters(benchmark::State& state, double bytes, double flops) {
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (flops > 0)
    state.counters["TFLOP/s"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_CudaCopy(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer src(b, nullptr, bytes), dst(b, nullptr, bytes);
  run(state, b, [&] { b->copy(dst.p, src.p, bytes); });
  counters(state, 2.0 * bytes, 0);
}

// y[M, out] = x[M, in] @ W^T over a bf16 W, bf16 precision.
void BM_CudaLinearBf16(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const int64_t M = state.range(0), out = state.range(1), in = state.range(2);
  const auto w = random(out * in, 1);
  std::vector<uint16_t> wb(w.size());
  ds::f32_to_bf16_row(wb.data(), w.data(), w.size());
  const auto x = random(M * in, 2);
  DeviceBuffer dw(b, wb.data(), wb.size() * 2), dx(b, x.data(), x.size() * 4), dy(b, nullptr, M * out * 4);
  const ds::ops::WeightView view{.data = dw.p, .dtype = ds::DType::BF16, .rows = out, .cols = in};
  ds::ops::set_matmul_precision(ds::ops::MatmulPrecision::kBf16);
  run(state, b, [&] { b->linear_forward(dy.f(), dx.f(), view, M, in, out, false); });
  counters(state, 2.0 * out * in + 4.0 * M * (in + out), 2.0 * M * out * in);
}

void BM_CudaRmsnorm(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const int64_t rows = state.range(0), dim = state.range(1);
  const auto x = random(rows * dim, 3), w = random(dim, 4);
  DeviceBuffer dx(b, x.data(), x.size() * 4), dw(b, w.data(), dim * 4), dy(b, nullptr, x.size() * 4),
      dr(b, nullptr, rows * 4);
  run(state, b, [&] { b->rmsnorm_forward(dy.f(), dr.f(), dx.f(), dw.f(), rows, dim, 1e-6f); });
  counters(state, 8.0 * rows * dim, 0);
}

void BM_CudaSiluMul(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const int64_t n = state.range(0);
  const auto a = random(n, 5), c = random(n, 6);
  DeviceBuffer da(b, a.data(), n * 4), dc(b, c.data(), n * 4), dy(b, nullptr, n * 4);
  run(state, b, [&] { b->silu_mul_forward(dy.f(), da.f(), dc.f(), n, 0.0f); });
  counters(state, 12.0 * n, 0);
}

void BM_CudaSoftmax(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const int64_t rows = state.range(0), cols = state.range(1);
  const auto x = random(rows * cols, 7);
  DeviceBuffer dx(b, x.data(), x.size() * 4), dy(b, nullptr, x.size() * 4);
  run(state, b, [&] { b->softmax_forward(dy.f(), dx.f(), rows, cols); });
  counters(state, 8.0 * rows * cols, 0);
}

// One decode step of MLA over the latent cache for `batch` sequences of
// `past` cached tokens each, DeepSeek-V3's shapes (128 heads, kv_lora 512,
// rope 64), float32 cache. Compulsory traffic: each sequence's c_kv and k_pe
// once, the absorbed W_UK and W_UV once, q and ctx.
void BM_CudaLatentDecode(benchmark::State& state) {
  const Backend* b = gpu(state);
  if (!b) return;
  const int64_t batch = state.range(0), past = state.range(1), T = past + 1;
  const ds::ops::LatentAttentionDims d{
      .heads = 128, .nope = 128, .rope = 64, .v_dim = 128, .kv_lora = 512, .scale = 0.0721688f};
  const int64_t qk = d.nope + d.rope;
  const auto absorbed = random(d.heads * (d.nope * 512 + 512 * 128), 8);
  const auto q = random(batch * d.heads * qk, 9);
  const auto cache = random(T * (d.kv_lora + d.rope), 10);
  DeviceBuffer da(b, absorbed.data(), absorbed.size() * 4), dq(b, q.data(), q.size() * 4),
      dctx(b, nullptr, batch * d.heads * d.v_dim * 4);
  // Every sequence its own cache (same contents).
  std::vector<std::unique_ptr<DeviceBuffer>> caches;
  std::vector<ds::ops::LatentQueries> seqs(batch);
  for (int64_t i = 0; i < batch; ++i) {
    caches.push_back(std::make_unique<DeviceBuffer>(b, cache.data(), cache.size() * 4));
    seqs[i] = {.q = dq.f() + i * d.heads * qk,
               .ctx = dctx.f() + i * d.heads * d.v_dim,
               .c_kv = caches.back()->f(),
               .k_pe = caches.back()->f() + T * d.kv_lora,
               .n = 1,
               .past = past};
  }
  run(state, b, [&] { b->latent_attention_forward(seqs.data(), batch, d.heads * qk, d.heads * d.v_dim, da.f(), d); });
  counters(state, 4.0 * (batch * T * (d.kv_lora + d.rope) + absorbed.size() + q.size() + batch * d.heads * d.v_dim),
           2.0 * batch * d.heads * T * (d.kv_lora + d.rope + d.kv_lora));
}

void register_all() {
  benchmark::RegisterBenchmark("cuda_copy/2GiB", BM_CudaCopy)->UseManualTime()->Unit(benchmark::kMicrosecond);
  // DeepSeek-V3's dense MLP up projection shape [18432, 7168].
  for (int64_t M : {1, 8, 64, 512, 4096})
    benchmark::RegisterBenchmark("cuda_linear_bf16", BM_CudaLinearBf16)
        ->Args({M, 18432, 7168})
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  for (int64_t batch : {1, 8, 64})
    benchmark::RegisterBenchmark("cuda_latent_decode", BM_CudaLatentDecode)
        ->Args({batch, 4095})
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("cuda_rmsnorm", BM_CudaRmsnorm)
      ->Args({4096, 7168})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("cuda_silu_mul", BM_CudaSiluMul)
      ->Args({int64_t{4096} * 18432})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("cuda_softmax", BM_CudaSoftmax)
      ->Args({64, 129280})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
