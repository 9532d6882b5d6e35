// Fused LM-head cross-entropy against the raw GEMM of the same shape.
//
//   OMP_NUM_THREADS=2 build/bench/cross_entropy_bench --benchmark_min_time=0.2
//
// GFLOP/s counts 2 N D V per [N, D] x [D, V] product: the forward is one
// product, the backward three (logits recomputed, dh, dW), whatever else the
// kernels do (exp, max, sums). The baselines compute the logits product alone
// with oneDNN's dnnl_sgemm and OpenBLAS's cblas_sgemm (W stored [V, D], as the
// Hugging Face lm_head weight, so both use B^T), so fused / sgemm is the share
// of GEMM speed the fused loss keeps. The plain path (materialised [N, V]
// logits, then the row-wise loss) is there for comparison.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <dnnl.h>

#include <string>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "ops/cross_entropy.h"
#include "ops/matmul.h"

namespace {

struct Shape {
  int64_t N, D, V;
};

struct Problem {
  Shape s;
  std::vector<float> h, w, loss, lse, dloss, dh, dw;
  std::vector<int32_t> targets;
  explicit Problem(Shape s_)
      : s(s_), h(s.N * s.D), w(s.V * s.D), loss(s.N), lse(s.N), dloss(s.N, 1.0f / s.N), dh(s.N * s.D), targets(s.N) {
    ds::fill_normal(h.data(), h.size(), 1.0f, 1);
    ds::fill_normal(w.data(), w.size(), 0.02f, 2);
    for (int64_t t = 0; t < s.N; ++t) targets[t] = static_cast<int32_t>((t * 7919) % s.V);
  }
};

void set_rate(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

double product_flops(const Shape& s) { return 2.0 * s.N * s.D * s.V; }

void BM_FusedForward(benchmark::State& state, Shape s, int64_t vocab_chunk) {
  Problem p(s);
  const ds::ops::CrossEntropyChunks chunks{256, vocab_chunk};
  for (auto _ : state) {
    ds::ops::lm_head_cross_entropy_forward(p.loss.data(), p.lse.data(), p.h.data(), p.w.data(), p.targets.data(), s.N,
                                           s.D, s.V, chunks);
    benchmark::DoNotOptimize(p.loss.data());
  }
  set_rate(state, product_flops(s));
}

void BM_FusedBackward(benchmark::State& state, Shape s, int64_t vocab_chunk) {
  Problem p(s);
  const ds::ops::CrossEntropyChunks chunks{256, vocab_chunk};
  ds::ops::lm_head_cross_entropy_forward(p.loss.data(), p.lse.data(), p.h.data(), p.w.data(), p.targets.data(), s.N,
                                         s.D, s.V, chunks);
  p.dw.assign(s.V * s.D, 0.0f);
  for (auto _ : state) {
    ds::ops::lm_head_cross_entropy_backward(p.dh.data(), p.dw.data(), p.dloss.data(), p.h.data(), p.w.data(),
                                            p.targets.data(), p.lse.data(), s.N, s.D, s.V, chunks);
    benchmark::DoNotOptimize(p.dw.data());
  }
  set_rate(state, 3.0 * product_flops(s));
}

// The plain path's forward: the engine's matmul into [N, V] logits, then the loss.
void BM_PlainForward(benchmark::State& state, Shape s) {
  Problem p(s);
  std::vector<float> logits(s.N * s.V);
  for (auto _ : state) {
    ds::ops::matmul_forward(logits.data(), p.h.data(), p.w.data(), s.N, s.V, s.D, false, true);
    ds::ops::cross_entropy_forward(p.loss.data(), p.lse.data(), logits.data(), p.targets.data(), s.N, s.V);
    benchmark::DoNotOptimize(p.loss.data());
  }
  set_rate(state, product_flops(s));
}

void BM_Dnnl(benchmark::State& state, Shape s) {
  Problem p(s);
  std::vector<float> logits(s.N * s.V);
  for (auto _ : state) {
    dnnl_sgemm('N', 'T', s.N, s.V, s.D, 1.0f, p.h.data(), s.D, p.w.data(), s.D, 0.0f, logits.data(), s.V);
    benchmark::DoNotOptimize(logits.data());
  }
  set_rate(state, product_flops(s));
}

void BM_Cblas(benchmark::State& state, Shape s) {
  Problem p(s);
  std::vector<float> logits(s.N * s.V);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.N, s.V, s.D, 1.0f, p.h.data(), s.D, p.w.data(), s.D, 0.0f,
                logits.data(), s.V);
    benchmark::DoNotOptimize(logits.data());
  }
  set_rate(state, product_flops(s));
}

std::string name(const Shape& s) { return std::to_string(s.N) + "x" + std::to_string(s.D) + "x" + std::to_string(s.V); }

void register_all() {
  const Shape shapes[] = {{512, 1024, 32768}};
  for (const Shape& s : shapes) {
    const std::string n = name(s);
    for (int64_t vc : {1024, 2048, 4096}) {
      const std::string c = "/vocab_chunk:" + std::to_string(vc);
      benchmark::RegisterBenchmark(("lm_head_ce/fused_fwd/" + n + c).c_str(), BM_FusedForward, s, vc)->UseRealTime();
      benchmark::RegisterBenchmark(("lm_head_ce/fused_bwd/" + n + c).c_str(), BM_FusedBackward, s, vc)->UseRealTime();
    }
    benchmark::RegisterBenchmark(("lm_head_ce/plain_fwd/" + n).c_str(), BM_PlainForward, s)->UseRealTime();
    benchmark::RegisterBenchmark(("lm_head_ce/dnnl_sgemm/" + n).c_str(), BM_Dnnl, s)->UseRealTime();
  }
  // OpenBLAS last: its worker threads keep spinning for a while after each
  // call and would steal the cores from whatever OpenMP code runs next.
  for (const Shape& s : shapes)
    benchmark::RegisterBenchmark(("lm_head_ce/cblas_sgemm/" + name(s)).c_str(), BM_Cblas, s)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
