// The backend table (ops/backend.h).
//
// BackendSeam runs everywhere: the ops' entry points reach the active
// backend's table, and asking for a backend this process lacks is one clear
// error.
//
// BackendOps is the harness every kernel of every other backend answers to
// (ggml's test-backend-ops): each op on random inputs, on the device, against
// the CPU's op on the same inputs, with every output first poisoned with NaN
// so that an element the kernel never wrote fails. It needs a backend besides
// the CPU's; where the build or the machine has none (CI: no GPU) its tests
// report SKIPPED with the reason, never passed.
//
// Tolerances are relative: ||device - cpu|| / ||cpu||. Where both sides do
// the same float32 operations per element (rmsnorm: double sums of squares,
// the same scale; rope: the same cos and sin) only the order of a row's sums
// and fused multiply-adds differ: 1e-6 (softmax: 2e-5 over a vocabulary-sized
// row, whose exps the CPU sums in float32). exp differs between the CPU's
// polynomial and the GPU's expf by a few ulp: 1e-6. linear sums products of
// the same (rounded) operands in another order over up to a few thousand
// terms: 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/activations.h"
#include "ops/backend.h"
#include "ops/embedding.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace ds::ops {
namespace {
namespace backend_ops_test {

// ---- the seam, on every machine ------------------------------------------

int g_calls = 0;

// The CPU's table with every op counted: stands in for a device backend.
const Backend& counting_backend() {
  static const Backend table = [] {
    Backend b = cpu_backend();
    b.name = "counting";
    b.linear_forward = [](float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                          bool acc) {
      ++g_calls;
      cpu::linear_forward(y, x, w, M, ldx, ldy, acc);
    };
    b.rmsnorm_forward = [](float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim,
                           float eps) {
      ++g_calls;
      cpu::rmsnorm_forward(y, rstd, x, w, rows, dim, eps);
    };
    b.silu_mul_forward = [](float* out, const float* a, const float* bb, int64_t n, float limit) {
      ++g_calls;
      cpu::silu_mul_forward(out, a, bb, n, limit);
    };
    b.sigmoid_forward = [](float* y, const float* x, int64_t n) {
      ++g_calls;
      cpu::sigmoid_forward(y, x, n);
    };
    b.softmax_forward = [](float* y, const float* x, int64_t rows, int64_t cols) {
      ++g_calls;
      cpu::softmax_forward(y, x, rows, cols);
    };
    b.rope_forward = [](float* y, const float* x, const int32_t* pos, const float* freqs, int64_t tokens, int64_t heads,
                        int64_t dim, int64_t ts, int64_t hs, RopeLayout layout) {
      ++g_calls;
      cpu::rope_forward(y, x, pos, freqs, tokens, heads, dim, ts, hs, layout);
    };
    b.embedding_forward = [](float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab,
                             int64_t dim) {
      ++g_calls;
      cpu::embedding_forward(out, ids, table, tokens, vocab, dim);
    };
    return b;
  }();
  return table;
}

// Restores the CPU's table however a test ends.
struct ActiveBackend {
  explicit ActiveBackend(const Backend& b) { set_active_backend(b); }
  ~ActiveBackend() { set_active_backend(cpu_backend()); }
};

TEST(BackendSeam, EveryOpEntryReachesTheActiveTable) {
  std::vector<float> x(6 * 8), w(8, 1.0f), y(x.size()), rstd(6), out(x.size());
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(gen);
  const std::vector<int32_t> ids = {0, 5, 2}, pos = {0, 1, 2, 3, 4, 5};
  std::vector<float> freqs(4);
  rope_frequencies(freqs.data(), RopeConfig{.dim = 8});
  const WeightView wv{.data = w.data(), .dtype = DType::F32, .rows = 1, .cols = 8};
  const ActiveBackend active(counting_backend());
  EXPECT_STREQ(active_backend().name, "counting");
  g_calls = 0;
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), 6, 8, 1e-6f);
  silu_mul_forward(out.data(), x.data(), y.data(), 48, 0.0f);
  sigmoid_forward(out.data(), x.data(), 48);
  softmax_forward(out.data(), x.data(), 6, 8);
  rope_forward(out.data(), x.data(), pos.data(), freqs.data(), 6, 1, 8, 8, 8, RopeLayout::Interleaved);
  embedding_forward(out.data(), ids.data(), x.data(), 3, 6, 8);
  linear_forward(out.data(), x.data(), wv, 6);
  EXPECT_EQ(g_calls, 7);
  // The entry gives the table's result.
  std::vector<float> direct(x.size()), rs(6);
  cpu::rmsnorm_forward(direct.data(), rs.data(), x.data(), w.data(), 6, 8, 1e-6f);
  EXPECT_EQ(direct, y);
}

TEST(BackendSeam, TheCpuIsActiveByDefaultAndACudaBackendIsFoundOrExplained) {
  EXPECT_EQ(active_backend().device, Device::CPU);
  EXPECT_EQ(&backend_for(Device::CPU), &cpu_backend());
  if (cuda_backend() == nullptr) {
    EXPECT_FALSE(cuda_status().empty());
    try {
      backend_for(Device::CUDA);
      FAIL() << "backend_for(CUDA) returned without a CUDA backend";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(cuda_status()), std::string::npos) << e.what();
    }
  } else {
    EXPECT_EQ(backend_for(Device::CUDA).device, Device::CUDA);
  }
}

// ---- every other backend against the CPU ----------------------------------

std::vector<const Backend*> devices() {
  std::vector<const Backend*> out;
  if (const Backend* c = cuda_backend()) out.push_back(c);
  return out;
}

#define FOR_EACH_DEVICE(b)                                                                  \
  if (devices().empty()) GTEST_SKIP() << "no backend besides the CPU's: " << cuda_status(); \
  for (const Backend* b : devices())

// Memory on a backend, freed on scope exit.
struct DeviceBuffer {
  const Backend* b;
  void* p;
  size_t bytes;
  DeviceBuffer(const Backend* be, size_t n) : b(be), p(be->alloc(n)), bytes(n) {}
  template <typename T>
  DeviceBuffer(const Backend* be, const std::vector<T>& v) : DeviceBuffer(be, v.size() * sizeof(T)) {
    b->upload(p, v.data(), bytes);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { b->free(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> read() const {
    std::vector<T> v(bytes / sizeof(T));
    b->download(v.data(), p, bytes);
    return v;
  }
};

// n floats of NaN: an output before the op.
DeviceBuffer poisoned(const Backend* b, size_t n) {
  return DeviceBuffer(b, std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(gen);
  return v;
}

// ||got - want|| / ||want||; infinity where got has a NaN that want lacks.
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    if (std::isnan(got[i]) || std::isinf(got[i]) != std::isinf(want[i])) return INFINITY;
    if (std::isinf(want[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

TEST(BackendOps, MemoryRoundTrips) {
  FOR_EACH_DEVICE(b) {
    const std::vector<float> v = randn(1000003, 7);
    DeviceBuffer d(b, v), e(b, v.size() * sizeof(float));
    b->copy(e.p, d.p, d.bytes);
    b->synchronize();
    EXPECT_EQ(e.read<float>(), v) << b->name;
  }
}

TEST(BackendOps, Rmsnorm) {
  FOR_EACH_DEVICE(b) {
    for (auto [rows, dim] : {std::pair<int64_t, int64_t>{1, 7}, {5, 512}, {33, 1000}, {4, 7168}}) {
      const auto x = randn(rows * dim, 11, 3.0f), w = randn(dim, 12);
      std::vector<float> y(x.size()), rstd(rows);
      cpu::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), rows, dim, 1e-6f);
      DeviceBuffer dx(b, x), dw(b, w);
      auto dy = poisoned(b, x.size()), dr = poisoned(b, rows);
      b->rmsnorm_forward(dy.as<float>(), dr.as<float>(), dx.as<float>(), dw.as<float>(), rows, dim, 1e-6f);
      EXPECT_LT(rel_err(dy.read<float>(), y), 1e-6) << b->name << " rows " << rows << " dim " << dim;
      EXPECT_LT(rel_err(dr.read<float>(), rstd), 1e-6) << b->name << " rows " << rows << " dim " << dim;
    }
  }
}

TEST(BackendOps, SiluMulAndSigmoid) {
  FOR_EACH_DEVICE(b) {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}}) {
      for (float limit : {0.0f, 7.0f}) {
        const auto a = randn(n, 21, 6.0f), c = randn(n, 22, 6.0f);
        std::vector<float> want(n);
        cpu::silu_mul_forward(want.data(), a.data(), c.data(), n, limit);
        DeviceBuffer da(b, a), dc(b, c);
        auto out = poisoned(b, n);
        b->silu_mul_forward(out.as<float>(), da.as<float>(), dc.as<float>(), n, limit);
        EXPECT_LT(rel_err(out.read<float>(), want), 1e-6) << b->name << " n " << n << " limit " << limit;
      }
      const auto x = randn(n, 23, 20.0f);
      std::vector<float> want(n);
      cpu::sigmoid_forward(want.data(), x.data(), n);
      DeviceBuffer dx(b, x);
      auto out = poisoned(b, n);
      b->sigmoid_forward(out.as<float>(), dx.as<float>(), n);
      EXPECT_LT(rel_err(out.read<float>(), want), 1e-6) << b->name << " sigmoid n " << n;
    }
  }
}

TEST(BackendOps, SoftmaxWithAFullyMaskedRow) {
  FOR_EACH_DEVICE(b) {
    for (auto [rows, cols] :
         {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {8, 4096}, {5, 4097}, {70000, 3}, {2, 129280}}) {
      auto x = randn(rows * cols, 31, 4.0f);
      for (int64_t j = 0; j < cols; ++j) x[j] = -std::numeric_limits<float>::infinity();  // row 0: masked
      if (rows > 1) x[cols + cols / 2] = -std::numeric_limits<float>::infinity();         // one masked entry
      std::vector<float> want(x.size());
      cpu::softmax_forward(want.data(), x.data(), rows, cols);
      DeviceBuffer dx(b, x);
      auto out = poisoned(b, x.size());
      b->softmax_forward(out.as<float>(), dx.as<float>(), rows, cols);
      const auto got = out.read<float>();
      // The CPU sums a row's exps in float32 (16 lanes x 4 accumulators), the
      // GPU in double: over 129280 columns the CPU's sum is off by a few 1e-6.
      EXPECT_LT(rel_err(got, want), cols > 10000 ? 2e-5 : 1e-6) << b->name << " rows " << rows << " cols " << cols;
      EXPECT_EQ(got[0], 0.0f) << "a fully masked row gives zeros";
    }
  }
}

TEST(BackendOps, RopeBothLayoutsStridedAndInPlace) {
  FOR_EACH_DEVICE(b) {
    for (RopeLayout layout : {RopeLayout::Interleaved, RopeLayout::HalfSplit}) {
      const int64_t tokens = 7, heads = 3, dim = 64, head_stride = dim + 2, token_stride = heads * head_stride + 5;
      std::vector<float> freqs(dim / 2);
      rope_frequencies(freqs.data(), RopeConfig{.dim = dim, .factor = 40.0, .beta_fast = 32, .beta_slow = 1});
      std::vector<int32_t> pos(tokens);
      std::mt19937 gen(41);
      for (auto& p : pos) p = static_cast<int32_t>(gen() % 163840);
      auto x = randn(tokens * token_stride, 42);
      std::vector<float> want = x;  // in place: the gaps between heads keep x
      cpu::rope_forward(want.data(), want.data(), pos.data(), freqs.data(), tokens, heads, dim, token_stride,
                        head_stride, layout);
      DeviceBuffer dx(b, x), dp(b, pos), df(b, freqs);
      b->rope_forward(dx.as<float>(), dx.as<float>(), dp.as<int32_t>(), df.as<float>(), tokens, heads, dim,
                      token_stride, head_stride, layout);
      EXPECT_LT(rel_err(dx.read<float>(), want), 1e-6) << b->name << " layout " << static_cast<int>(layout);
    }
  }
}

TEST(BackendOps, EmbeddingAndABadIdLeavesTheOutputAlone) {
  FOR_EACH_DEVICE(b) {
    const int64_t vocab = 50, dim = 33;
    const auto table = randn(vocab * dim, 51);
    const std::vector<int32_t> ids = {0, 49, 3, 3, 17, 0, 48, 1, 2};
    const int64_t tokens = static_cast<int64_t>(ids.size());
    std::vector<float> want(tokens * dim);
    cpu::embedding_forward(want.data(), ids.data(), table.data(), tokens, vocab, dim);
    DeviceBuffer dt(b, table), di(b, ids);
    auto out = poisoned(b, want.size());
    b->embedding_forward(out.as<float>(), di.as<int32_t>(), dt.as<float>(), tokens, vocab, dim);
    EXPECT_EQ(out.read<float>(), want) << b->name;
    std::vector<int32_t> bad = ids;
    bad[4] = 50;
    DeviceBuffer db(b, bad);
    auto out2 = poisoned(b, want.size());
    EXPECT_THROW(b->embedding_forward(out2.as<float>(), db.as<int32_t>(), dt.as<float>(), tokens, vocab, dim), Error);
    for (float v : out2.read<float>()) ASSERT_TRUE(std::isnan(v)) << "written before the ids were checked";
  }
}

struct Weight {
  std::vector<uint8_t> data;
  std::vector<float> scale_inv;
  WeightView view(const void* d, const float* s) const {
    return {.data = d, .dtype = dtype, .rows = rows, .cols = cols, .scale_inv = s};
  }
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
};

Weight make_weight(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  const auto w = randn(rows * cols, seed, 0.05f);
  Weight out;
  out.dtype = dtype;
  out.rows = rows;
  out.cols = cols;
  switch (dtype) {
    case DType::F32:
      out.data.resize(w.size() * 4);
      std::memcpy(out.data.data(), w.data(), out.data.size());
      break;
    case DType::BF16:
    case DType::F16: {
      std::vector<uint16_t> h(w.size());
      for (size_t i = 0; i < w.size(); ++i) h[i] = dtype == DType::BF16 ? f32_to_bf16(w[i]) : f32_to_f16(w[i]);
      out.data.resize(h.size() * 2);
      std::memcpy(out.data.data(), h.data(), out.data.size());
      break;
    }
    default:  // e4m3, 128x128 blocks with partial ones at the edges
      out.data.resize(w.size());
      out.scale_inv.resize(((rows + 127) / 128) * ((cols + 127) / 128));
      quantize_fp8_blocks(out.data.data(), out.scale_inv.data(), w.data(), rows, cols);
  }
  return out;
}

struct Precision {
  explicit Precision(MatmulPrecision p) : saved(matmul_precision()) { set_matmul_precision(p); }
  ~Precision() { set_matmul_precision(saved); }
  MatmulPrecision saved;
};

TEST(BackendOps, LinearEveryFloatingWeightDtypeBothPrecisions) {
  FOR_EACH_DEVICE(b) {
    for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3}) {
      const int64_t rows = 300, cols = 260;
      const Weight w = make_weight(dtype, rows, cols, 61);
      DeviceBuffer dwd(b, w.data);
      std::unique_ptr<DeviceBuffer> dsc;
      if (!w.scale_inv.empty()) dsc = std::make_unique<DeviceBuffer>(b, w.scale_inv);
      const WeightView host = w.view(w.data.data(), w.scale_inv.empty() ? nullptr : w.scale_inv.data());
      const WeightView dev = w.view(dwd.p, dsc ? dsc->as<float>() : nullptr);
      for (MatmulPrecision prec : {MatmulPrecision::kF32, MatmulPrecision::kBf16}) {
        const Precision p(prec);
        for (int64_t M : {1, 3, 8, 9, 64, 257}) {
          // Strided x and y, accumulating into y on every other size.
          const bool acc = M % 2 == 1;
          const int64_t ldx = cols + 3, ldy = rows + 5;
          const auto x = randn(M * ldx, 62 + M);
          auto y0 = randn(M * ldy, 63 + M);
          std::vector<float> want = y0;
          cpu::linear_forward(want.data(), x.data(), host, M, ldx, ldy, acc);
          DeviceBuffer dx(b, x), dy(b, y0);
          b->linear_forward(dy.as<float>(), dx.as<float>(), dev, M, ldx, ldy, acc);
          EXPECT_LT(rel_err(dy.read<float>(), want), 1e-5)
              << b->name << " " << dtype_name(dtype) << " M " << M << " precision " << matmul_precision_name(prec);
        }
      }
    }
  }
}

// One sequence of a latent attention case: n queries after `past` cached
// tokens, dense, or (n = 1) sparse over `past + 1` of the cache's tokens.
struct LatentSeq {
  int64_t n, past;
  bool sparse;
};

void check_latent_attention(const Backend* b, const LatentAttentionDims& d, const std::vector<LatentSeq>& seqs,
                            uint32_t seed) {
  const int64_t qk = d.nope + d.rope, ldq = d.heads * qk + 3, ldc = d.heads * d.v_dim + 5;
  const auto kv_b = randn(d.heads * (d.nope + d.v_dim) * d.kv_lora, seed, 0.05f);
  const WeightView kv_b_view{
      .data = kv_b.data(), .dtype = DType::F32, .rows = d.heads * (d.nope + d.v_dim), .cols = d.kv_lora};
  const std::vector<float> absorbed = absorb_kv_b(kv_b_view, d);
  DeviceBuffer d_abs(b, absorbed);
  // Host and device copies of every sequence's inputs.
  struct Data {
    std::vector<float> q, c_kv, k_pe, ctx;
    std::vector<int32_t> keys;
    std::unique_ptr<DeviceBuffer> dq, dc, dk, dctx, dkeys;
  };
  std::vector<Data> data(seqs.size());
  std::vector<LatentQueries> host(seqs.size()), dev(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const LatentSeq& sq = seqs[i];
    const int64_t tokens = sq.sparse ? 2 * sq.past + 7 : sq.past + sq.n;
    Data& x = data[i];
    x.q = randn(sq.n * ldq, seed + 10 * i + 1);
    x.c_kv = randn(tokens * d.kv_lora, seed + 10 * i + 2);
    x.k_pe = randn(tokens * d.rope, seed + 10 * i + 3);
    x.ctx = randn(sq.n * ldc, seed + 10 * i + 4);  // the gaps between rows must survive
    if (sq.sparse) {
      std::mt19937 gen(seed + 10 * i + 5);
      for (int32_t t = 0; t < tokens; ++t)
        if (static_cast<int64_t>(x.keys.size()) < sq.past + 1 && gen() % 2) x.keys.push_back(t);
      for (int32_t t = tokens - 1; static_cast<int64_t>(x.keys.size()) < sq.past + 1; --t)
        if (std::find(x.keys.begin(), x.keys.end(), t) == x.keys.end()) x.keys.push_back(t);
      std::sort(x.keys.begin(), x.keys.end());
    }
    x.dq = std::make_unique<DeviceBuffer>(b, x.q);
    x.dc = std::make_unique<DeviceBuffer>(b, x.c_kv);
    x.dk = std::make_unique<DeviceBuffer>(b, x.k_pe);
    x.dctx = std::make_unique<DeviceBuffer>(b, x.ctx);
    if (sq.sparse) x.dkeys = std::make_unique<DeviceBuffer>(b, x.keys);
    host[i] = {.q = x.q.data(),
               .ctx = x.ctx.data(),
               .c_kv = x.c_kv.data(),
               .k_pe = x.k_pe.data(),
               .n = sq.n,
               .past = sq.past,
               .keys = sq.sparse ? x.keys.data() : nullptr};
    dev[i] = {.q = x.dq->as<float>(),
              .ctx = x.dctx->as<float>(),
              .c_kv = x.dc->as<float>(),
              .k_pe = x.dk->as<float>(),
              .n = sq.n,
              .past = sq.past,
              .keys = sq.sparse ? x.dkeys->as<int32_t>() : nullptr};
  }
  cpu::latent_attention_forward(host.data(), static_cast<int64_t>(host.size()), ldq, ldc, absorbed.data(), d);
  b->latent_attention_forward(dev.data(), static_cast<int64_t>(dev.size()), ldq, ldc, d_abs.as<float>(), d);
  for (size_t i = 0; i < seqs.size(); ++i)
    EXPECT_LT(rel_err(data[i].dctx->read<float>(), data[i].ctx), 1e-5)
        << b->name << " heads " << d.heads << " sequence " << i << " n " << seqs[i].n << " past " << seqs[i].past
        << (seqs[i].sparse ? " sparse" : "");
}

// The scores are dot products of 100 to 600 terms and the outputs sums over
// up to 3000 keys, in another order than the CPU's tiles: 1e-5.
TEST(BackendOps, LatentAttentionManySequencesDenseAndSparse) {
  FOR_EACH_DEVICE(b) {
    // Odd sizes: 20 heads (a partial group of 16), padded kv_lora and v_dim.
    check_latent_attention(b, {.heads = 20, .nope = 16, .rope = 8, .v_dim = 12, .kv_lora = 40, .scale = 0.1f},
                           {{1, 0, false}, {1, 700, false}, {5, 37, false}, {1, 20, true}}, 71);
    // DeepSeek-V3's shapes: 128 heads, kv_lora 512, a long cache and a batch.
    const LatentAttentionDims v3{
        .heads = 128, .nope = 128, .rope = 64, .v_dim = 128, .kv_lora = 512, .scale = 0.0721688f};
    check_latent_attention(b, v3, {{1, 3000, false}, {1, 0, false}, {3, 100, false}, {1, 63, true}}, 72);
  }
}

TEST(BackendOps, LinearRefusesWhatItCannotRun) {
  FOR_EACH_DEVICE(b) {
    std::vector<uint8_t> packed(64 * 32), scales(64);
    DeviceBuffer d(b, packed), s(b, scales), x(b, 64 * 4), y(b, 64 * 4);
    const WeightView fp4{.data = d.p, .dtype = DType::F4E2M1, .rows = 64, .cols = 64, .scale_e8m0 = s.as<uint8_t>()};
    EXPECT_THROW(b->linear_forward(y.as<float>(), x.as<float>(), fp4, 1, 64, 64, false), Error);
  }
}

}  // namespace backend_ops_test
}  // namespace
}  // namespace ds::ops
