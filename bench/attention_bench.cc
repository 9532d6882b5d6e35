// Attention throughput: the tiled causal kernels at DeepSeek-V3's MLA head
// sizes (Dqk 192, Dv 128), against raw sgemm (oneDNN and OpenBLAS) at
// comparable sizes, so that the fraction of the BLAS rate the attention
// reaches can be read off.
//
//   OMP_NUM_THREADS=2 build/bench/attention_bench --benchmark_min_time=0.2
//
// FLOP counts (reported as GFLOP/s):
//   forward: the two products over the allowed (query, key) pairs,
//            2 (Dqk + Dv) per pair; causal: B H T (T + 1) / 2 pairs.
//   backward: 2.5x the forward count, the convention of the FlashAttention
//            papers (five products instead of two). The kernel actually
//            multiplies more: it recomputes S and dP in both of its passes,
//            2 (4 Dqk + 3 Dv) per pair, 3.6x the forward count at these sizes.
//   sgemm: 2 M N K.
// Packed-document variants count only the pairs inside each document.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <dnnl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench_main.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"
#include "ops/matmul.h"

namespace {

struct Shape {
  int64_t B, T, H, Dqk, Dv;
  int64_t segment;  // document length in a packed row; 0: one document
};

// Allowed (query, key) pairs over the whole batch.
double pairs(const Shape& s) {
  auto tri = [](double n) { return n * (n + 1) / 2; };
  if (s.segment == 0) return s.B * s.H * tri(s.T);
  const int64_t full = s.T / s.segment, rest = s.T % s.segment;
  return s.B * s.H * (full * tri(s.segment) + tri(rest));
}

struct Buffers {
  ds::ops::AttentionDims d;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<int32_t> seg;
  explicit Buffers(const Shape& s)
      : d{s.B, s.T, s.H, s.Dqk, s.Dv, static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.Dqk)))},
        q(s.B * s.T * s.H * s.Dqk),
        k(q.size()),
        v(s.B * s.T * s.H * s.Dv),
        out(v.size()),
        lse(s.B * s.H * s.T),
        dout(v.size()),
        dq(q.size()),
        dk(q.size()),
        dv(v.size()) {
    ds::fill_normal(q.data(), q.size(), 1.0f, 1);
    ds::fill_normal(k.data(), k.size(), 1.0f, 2);
    ds::fill_normal(v.data(), v.size(), 1.0f, 3);
    ds::fill_normal(dout.data(), dout.size(), 1.0f, 4);
    if (s.segment > 0)
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t t = 0; t < s.T; ++t) seg.push_back(static_cast<int32_t>(t / s.segment));
  }
  const int32_t* ids() const { return seg.empty() ? nullptr : seg.data(); }
  void forward() { ds::ops::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), ids(), d); }
  void backward() {
    ds::ops::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(),
                                k.data(), v.data(), ids(), d);
  }
};

void set_rate(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Forward(benchmark::State& state, Shape s) {
  Buffers x(s);
  for (auto _ : state) {
    x.forward();
    benchmark::DoNotOptimize(x.out.data());
  }
  set_rate(state, 2.0 * pairs(s) * (s.Dqk + s.Dv));
}

void BM_Backward(benchmark::State& state, Shape s) {
  Buffers x(s);
  x.forward();
  for (auto _ : state) {
    x.backward();
    benchmark::DoNotOptimize(x.dq.data());
  }
  set_rate(state, 2.5 * 2.0 * pairs(s) * (s.Dqk + s.Dv));
}

// MLA decode over the latent cache: B sequences of T cached tokens, one new
// query each (n = 1), one call for the batch. FLOPs per sequence: the two
// absorptions 2 H kvl (nope + v) and the attention 2 H T (2 kvl + rope).
struct Latent {
  int64_t B, T;
  ds::ops::LatentAttentionDims d;
};

struct LatentBuffers {
  Latent s;
  std::vector<float> q, ckv, kpe, kvb, absorbed, ctx;
  explicit LatentBuffers(const Latent& l)
      : s(l),
        q(l.B * l.d.heads * (l.d.nope + l.d.rope)),
        ckv(l.B * l.T * l.d.kv_lora),
        kpe(l.B * l.T * l.d.rope),
        kvb(l.d.heads * (l.d.nope + l.d.v_dim) * l.d.kv_lora),
        ctx(l.B * l.d.heads * l.d.v_dim) {
    ds::fill_normal(q.data(), q.size(), 1.0f, 7);
    ds::fill_normal(ckv.data(), ckv.size(), 1.0f, 8);
    ds::fill_normal(kpe.data(), kpe.size(), 1.0f, 9);
    ds::fill_normal(kvb.data(), kvb.size(), 0.05f, 10);
    absorbed = ds::ops::absorb_kv_b({kvb.data(), ds::DType::F32, l.d.heads * (l.d.nope + l.d.v_dim), l.d.kv_lora},
                                    l.d);
  }
  int64_t qk() const { return s.d.nope + s.d.rope; }
  void run() {
    std::vector<ds::ops::LatentQueries> seqs(static_cast<size_t>(s.B));
    for (int64_t b = 0; b < s.B; ++b) {
      auto& sq = seqs[static_cast<size_t>(b)];
      sq.q = q.data() + b * s.d.heads * qk();
      sq.ctx = ctx.data() + b * s.d.heads * s.d.v_dim;
      sq.c_kv = ckv.data() + b * s.T * s.d.kv_lora;
      sq.k_pe = kpe.data() + b * s.T * s.d.rope;
      sq.past = s.T - 1;
    }
    ds::ops::latent_attention_forward(seqs.data(), s.B, s.d.heads * qk(), s.d.heads * s.d.v_dim, absorbed.data(), s.d);
  }
  // The same on sgemm calls, as the engine ran it before the register
  // tiles: per sequence (one thread each), q_lat per head, the scores and
  // P c_kv of all heads at once, then W_UV per head, from kv_b as it is.
  void run_gemm() {
    const auto& d = s.d;
    const int64_t H = d.heads, kvl = d.kv_lora, T = s.T;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < s.B; ++b) {
      std::vector<float> lat(H * kvl), qpe(H * d.rope), S(H * T);
      const float* qb = q.data() + b * H * qk();
      const float* cb = ckv.data() + b * T * kvl;
      for (int64_t h = 0; h < H; ++h) {
        ds::ops::gemm(false, false, 1, kvl, d.nope, 1.0f, qb + h * qk(), qk(), kvb.data() + h * (d.nope + d.v_dim) * kvl,
                      kvl, 0.0f, &lat[h * kvl], kvl);
        std::copy_n(qb + h * qk() + d.nope, d.rope, &qpe[h * d.rope]);
      }
      ds::ops::gemm(false, true, H, T, kvl, d.scale, lat.data(), kvl, cb, kvl, 0.0f, S.data(), T);
      ds::ops::gemm(false, true, H, T, d.rope, d.scale, qpe.data(), d.rope, kpe.data() + b * T * d.rope, d.rope, 1.0f,
                    S.data(), T);
      ds::ops::causal_softmax_rows(S.data(), H, 1, T - 1, T);
      ds::ops::gemm(false, false, H, kvl, T, 1.0f, S.data(), T, cb, kvl, 0.0f, lat.data(), kvl);
      for (int64_t h = 0; h < H; ++h)
        ds::ops::gemm(false, true, 1, d.v_dim, kvl, 1.0f, &lat[h * kvl], kvl,
                      kvb.data() + (h * (d.nope + d.v_dim) + d.nope) * kvl, kvl, 0.0f,
                      ctx.data() + (b * H + h) * d.v_dim, d.v_dim);
    }
  }
  double flops() const {
    const auto& d = s.d;
    return 2.0 * s.B * d.heads * (d.kv_lora * (d.nope + d.v_dim) + s.T * (2 * d.kv_lora + d.rope));
  }
};

void BM_Latent(benchmark::State& state, Latent l, bool tiles) {
  LatentBuffers x(l);
  for (auto _ : state) {
    tiles ? x.run() : x.run_gemm();
    benchmark::DoNotOptimize(x.ctx.data());
  }
  set_rate(state, x.flops());
}

// The same decode step as a model runs it: each call is the next of enough
// layers (at least 8, 256 MiB of bf16 kv_b in all) that its weights come
// from memory, not the caches. The
// absorptions read the float32 absorbed copy, or kv_b itself in bf16 or in
// e4m3 with 128 x 128 scale blocks (LatentAttentionDims::kv_b). Counter
// weight_GB/s: the weight bytes a call reads over its time.
enum class LatentWeights { kAbsorbedF32, kKvBBf16, kKvBFp8 };

void BM_LatentCold(benchmark::State& state, Latent l, LatentWeights which) {
  LatentBuffers x(l);
  const auto& d = l.d;
  const int64_t rows = d.heads * (d.nope + d.v_dim), kvl = d.kv_lora;
  const int kLayers = static_cast<int>(std::max<int64_t>(8, (int64_t{256} << 20) / (2 * rows * kvl)));
  std::vector<std::vector<float>> absorbed;
  std::vector<std::vector<uint16_t>> bf16;
  std::vector<std::vector<uint8_t>> fp8;
  std::vector<std::vector<float>> scales;
  std::vector<ds::ops::WeightView> views;
  for (int i = 0; i < kLayers; ++i) {
    std::vector<float> w(static_cast<size_t>(rows * kvl));
    ds::fill_normal(w.data(), w.size(), 0.05f, 20 + i);
    if (which == LatentWeights::kAbsorbedF32) {
      absorbed.push_back(ds::ops::absorb_kv_b({w.data(), ds::DType::F32, rows, kvl}, d));
    } else if (which == LatentWeights::kKvBBf16) {
      bf16.emplace_back(w.size());
      for (size_t j = 0; j < w.size(); ++j) bf16.back()[j] = ds::f32_to_bf16(w[j]);
    } else {
      fp8.emplace_back(w.size());
      scales.emplace_back(static_cast<size_t>((rows + 127) / 128 * ((kvl + 127) / 128)));
      ds::ops::quantize_fp8_blocks(fp8.back().data(), scales.back().data(), w.data(), rows, kvl, 128, 128);
    }
  }
  for (int i = 0; i < kLayers && which != LatentWeights::kAbsorbedF32; ++i)
    views.push_back(which == LatentWeights::kKvBBf16
                        ? ds::ops::WeightView{bf16[i].data(), ds::DType::BF16, rows, kvl}
                        : ds::ops::WeightView{fp8[i].data(), ds::DType::F8E4M3, rows, kvl, scales[i].data(), 128, 128});
  std::vector<ds::ops::LatentQueries> seqs(static_cast<size_t>(l.B));
  for (int64_t b = 0; b < l.B; ++b) {
    auto& sq = seqs[static_cast<size_t>(b)];
    sq.q = x.q.data() + b * d.heads * x.qk();
    sq.ctx = x.ctx.data() + b * d.heads * d.v_dim;
    sq.c_kv = x.ckv.data() + b * l.T * kvl;
    sq.k_pe = x.kpe.data() + b * l.T * d.rope;
    sq.past = l.T - 1;
  }
  int layer = 0;
  double bytes = 0;
  for (auto _ : state) {
    ds::ops::LatentAttentionDims dd = d;
    const float* abs = nullptr;
    if (which == LatentWeights::kAbsorbedF32) {
      abs = absorbed[layer].data();
      bytes += static_cast<double>(absorbed[layer].size()) * sizeof(float);
    } else {
      dd.kv_b = &views[layer];
      bytes += static_cast<double>(rows * kvl) * (which == LatentWeights::kKvBBf16 ? 2.0 : 1.0);
    }
    ds::ops::latent_attention_forward(seqs.data(), l.B, d.heads * x.qk(), d.heads * d.v_dim, abs, dd);
    benchmark::DoNotOptimize(x.ctx.data());
    layer = (layer + 1) % kLayers;
  }
  set_rate(state, x.flops());
  state.counters["weight_GB/s"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsRate);
}

struct Gemm {
  int64_t M, N, K;
};

void BM_Dnnl(benchmark::State& state, Gemm g) {
  std::vector<float> a(g.M * g.K), b(g.K * g.N), c(g.M * g.N);
  ds::fill_normal(a.data(), a.size(), 1.0f, 5);
  ds::fill_normal(b.data(), b.size(), 1.0f, 6);
  for (auto _ : state) {
    dnnl_sgemm('N', 'N', g.M, g.N, g.K, 1.0f, a.data(), g.K, b.data(), g.N, 0.0f, c.data(), g.N);
    benchmark::DoNotOptimize(c.data());
  }
  set_rate(state, 2.0 * g.M * g.N * g.K);
}

void BM_Cblas(benchmark::State& state, Gemm g) {
  std::vector<float> a(g.M * g.K), b(g.K * g.N), c(g.M * g.N);
  ds::fill_normal(a.data(), a.size(), 1.0f, 5);
  ds::fill_normal(b.data(), b.size(), 1.0f, 6);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.M, g.N, g.K, 1.0f, a.data(), g.K, b.data(), g.N, 0.0f,
                c.data(), g.N);
    benchmark::DoNotOptimize(c.data());
  }
  set_rate(state, 2.0 * g.M * g.N * g.K);
}

std::string name(const Shape& s) {
  std::string n = fmt::format("B{}_T{}_H{}_Dqk{}_Dv{}", s.B, s.T, s.H, s.Dqk, s.Dv);
  if (s.segment) n += fmt::format("_docs{}", s.segment);
  return n;
}

std::string name(const Gemm& g) { return fmt::format("{}x{}x{}", g.M, g.N, g.K); }

void register_all() {
  // MLA heads at T = 1024, one sequence; then the same tokens packed as four
  // documents of 256 (most key tiles are skipped); then a longer sequence.
  const Shape shapes[] = {
      {1, 1024, 16, 192, 128, 0}, {1, 1024, 16, 192, 128, 256}, {1, 4096, 4, 192, 128, 0},
      {1, 128, 6, 48, 32, 0},     {4, 128, 6, 48, 32, 0},
  };
  for (const Shape& s : shapes) {
    benchmark::RegisterBenchmark(("attention/fwd/" + name(s)).c_str(), BM_Forward, s)->UseRealTime();
    benchmark::RegisterBenchmark(("attention/bwd/" + name(s)).c_str(), BM_Backward, s)->UseRealTime();
  }
  // Decode over the latent cache: the small preset's heads (6 heads, kvl 128),
  // then DeepSeek-V3's (128 heads, nope 128, rope 64, v 128, kvl 512).
  const ds::ops::LatentAttentionDims small{6, 32, 16, 32, 128, 0.144f}, v3{128, 128, 64, 128, 512, 0.0722f};
  const Latent latents[] = {{1, 128, small}, {8, 128, small}, {8, 1024, small}, {1, 1024, v3}, {8, 1024, v3},
                            {1, 8192, v3}};
  for (const Latent& l : latents) {
    const std::string n = fmt::format("H{}_kvl{}_B{}_T{}", l.d.heads, l.d.kv_lora, l.B, l.T);
    benchmark::RegisterBenchmark(("latent_decode/tiles/" + n).c_str(), BM_Latent, l, true)->UseRealTime();
    benchmark::RegisterBenchmark(("latent_decode/sgemm/" + n).c_str(), BM_Latent, l, false)->UseRealTime();
  }
  // A decode step's weights from memory: DeepSeek-V3's heads, and the
  // configs/bench-1gb.yml model's (8 heads, nope 64, v 64, kvl 256).
  // DeepSeek-V2-Lite's heads (16, nope 128, v 128, kvl 512) between them.
  const ds::ops::LatentAttentionDims bench1gb{8, 64, 32, 64, 256, 0.1f}, v2lite{16, 128, 64, 128, 512, 0.0722f};
  const Latent cold[] = {{1, 1024, v3}, {8, 1024, v3}, {1, 1024, v2lite}, {1, 256, bench1gb}};
  for (const Latent& l : cold) {
    const std::string n = fmt::format("H{}_kvl{}_B{}_T{}", l.d.heads, l.d.kv_lora, l.B, l.T);
    benchmark::RegisterBenchmark(("latent_cold/absorbed_f32/" + n).c_str(), BM_LatentCold, l,
                                 LatentWeights::kAbsorbedF32)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("latent_cold/kv_b_bf16/" + n).c_str(), BM_LatentCold, l, LatentWeights::kKvBBf16)
        ->UseRealTime();
    if (l.d.nope % 128 == 0 && l.d.v_dim % 128 == 0)  // (else e4m3 takes the absorbed copy: ops::reads_kv_b)
      benchmark::RegisterBenchmark(("latent_cold/kv_b_fp8/" + n).c_str(), BM_LatentCold, l, LatentWeights::kKvBFp8)
          ->UseRealTime();
  }
  // Square, and the skinny product of the score tiles' shape (K = Dqk).
  const Gemm gemms[] = {{1024, 1024, 1024}, {1024, 1024, 192}, {128, 128, 48}, {128, 32, 128}};
  for (const Gemm& g : gemms)
    benchmark::RegisterBenchmark(("sgemm/dnnl/" + name(g)).c_str(), BM_Dnnl, g)->UseRealTime();
  // OpenBLAS last: its worker threads keep spinning for a while after each
  // call and would steal the cores from whatever OpenMP code runs next.
  for (const Gemm& g : gemms)
    benchmark::RegisterBenchmark(("sgemm/cblas/" + name(g)).c_str(), BM_Cblas, g)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, register_all); }
