// gemm in bf16 (ops/matmul.h's GemmDtype::kBf16): both operands are rounded
// to bf16, then multiplied with float32 sums, by oneDNN's bf16 matmul where
// the CPU has bf16 dot products and by sgemm over the rounded values
// elsewhere.
//
// An operand that is not prepared already (PreparedOperand, or inside the
// live ScopedBf16Weights) is rounded into a compact copy in the calling
// thread's buffer: M K + K N conversions against M N K multiply-adds. The
// blocks of C (gemm_block_shape, cut less finely than the float32 path's)
// read the copies.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <dnnl.hpp>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/cpu/gemm_internal.h"
#include "ops/linear.h"

namespace ds::ops::detail {

namespace {

// Below this many multiply-adds (a few microseconds of work) a call goes to
// sgemm over the rounded values: a oneDNN primitive's fixed cost per call
// would take what its faster products save (small tiles). The choice
// depends on the shape alone.
std::atomic<double> g_min_primitive_work{1 << 21};

// Products are cut into blocks of at least this many multiply-adds (the
// float32 path: 2^21). A bf16 block does its work in half the time and its
// primitive call packs its share of B again: on `small`'s training step
// (Zen 5, 2 threads; train_step_bench TrainStepBf16/small/full with this
// constant changed) 2^23 ran 5-8% faster than 2^21, 2^24 slower again.
constexpr double kMinBlockWork = 1 << 23;

// One row of cols elements rounded to the nearest bf16: as bf16 codes
// (T = uint16_t) or as their float32 values (T = float).
template <typename T>
void round_row(T* dst, const float* src, int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, cols * sizeof(float));
    round_to_bf16(dst, static_cast<size_t>(cols));
  } else {
    f32_to_bf16_row(dst, src, static_cast<size_t>(cols));
  }
}

// Copies the [rows, cols] matrix at src (leading dimension ld) into dst
// [rows, cols] (compact), each element rounded to the nearest bf16: as bf16
// codes (T = uint16_t) or as their float32 values (T = float). Inside a
// parallel region (an op's tiles) no nested region is opened: even one
// of a single thread costs libgomp a team.
template <typename T>
void round_copy(T* dst, const float* src, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) {
    if (omp_in_parallel() || rows * cols < (1 << 16)) {
      round_row(dst, src, rows * cols);
      return;
    }
  } else if (omp_in_parallel() || rows * cols < (1 << 16) || rows == 1) {
    for (int64_t r = 0; r < rows; ++r) round_row(dst + r * cols, src + r * ld, cols);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) round_row(dst + r * cols, src + r * ld, cols);
}

// One bf16 matmul primitive per call shape, kept per thread with its memory
// objects and scratchpad, so that a call allocates nothing and takes no lock
// (attention and the grouped matmul call gemm from every thread of a
// parallel region). Creating one costs about half a millisecond (oneDNN
// compiles it; its own cache of compiled primitives is shared by the
// threads); training repeats its shapes every step.
struct PrimitiveKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  uint32_t alpha, beta;
  bool operator==(const PrimitiveKey&) const = default;
};

struct PrimitiveKeyHash {
  size_t operator()(const PrimitiveKey& k) const {
    size_t h = 1469598103934665603ull;
    for (const uint64_t v :
         {uint64_t(k.m), uint64_t(k.n), uint64_t(k.k), uint64_t(k.lda), uint64_t(k.ldb), uint64_t(k.ldc),
          uint64_t(k.trans_a) << 1 | uint64_t(k.trans_b), uint64_t(k.alpha) << 32 | k.beta})
      h = (h ^ v) * 1099511628211ull;
    return h;
  }
};

struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory a, b, c, scratch;
  Buffer<uint8_t> scratch_bytes;
  std::unordered_map<int, dnnl::memory> args;  // the four above, by argument
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// More shapes than this on one thread empty its cache rather than grow it
// without bound.
constexpr size_t kMaxPrimitives = 2048;

Primitive& primitive_for(const PrimitiveKey& key) {
  thread_local std::unordered_map<PrimitiveKey, Primitive, PrimitiveKeyHash> cache;
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= kMaxPrimitives) cache.clear();
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  // Stored A is [m, k] (lda) or [k, m] (trans_a); stored B is [k, n] or [n, k].
  const dnnl::memory::desc a(dims{key.m, key.k}, dt::bf16, key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  const dnnl::memory::desc b(dims{key.k, key.n}, dt::bf16, key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  const dnnl::memory::desc c(dims{key.m, key.n}, dt::f32, dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const float alpha = std::bit_cast<float>(key.alpha), beta = std::bit_cast<float>(key.beta);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
  Primitive p;
  p.matmul = dnnl::matmul(pd);
  dnnl::engine& engine = cpu_engine();
  p.a = dnnl::memory(a, engine, nullptr);
  p.b = dnnl::memory(b, engine, nullptr);
  p.c = dnnl::memory(c, engine, nullptr);
  p.scratch_bytes.resize(std::max<size_t>(pd.scratchpad_desc().get_size(), 1));
  p.scratch = dnnl::memory(pd.scratchpad_desc(), engine, p.scratch_bytes.data());
  p.args = {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}, {DNNL_ARG_SCRATCHPAD, p.scratch}};
  return cache.emplace(key, std::move(p)).first->second;
}

// C block [m, n] = alpha op(A) op(B) + beta C on bf16 codes; one thread.
void run_block(const PrimitiveKey& key, const uint16_t* A, const uint16_t* B, float* C) {
  Primitive& p = primitive_for(key);
  thread_local dnnl::stream stream(cpu_engine());
  p.a.set_data_handle(const_cast<uint16_t*>(A));
  p.b.set_data_handle(const_cast<uint16_t*>(B));
  p.c.set_data_handle(C);
  SingleThreaded one;
  p.matmul.execute(stream, p.args);  // (the memory objects share their handles with args' copies)
}

// The calling thread's buffer `which` (0: A, 1: B) for n elements of T,
// grown as needed and kept: gemm calls on one thread never overlap.
template <typename T>
T* operand_buffer(int which, int64_t n) {
  thread_local Buffer<T> buffers[2];
  Buffer<T>& b = buffers[which];
  if (b.size() < static_cast<size_t>(n)) b.resize(static_cast<size_t>(n));
  return b.data();
}

// A stored operand [rows, cols] with its leading dimension, in the form one
// path multiplies: prepared operands are used in place, others are converted
// into the calling thread's buffer `which` (compact).
template <typename T>
struct Matrix {
  const T* data;
  int64_t ld;
};

// The live ScopedBf16Weights: the float32 range and its prepared copy.
struct WeightCopy {
  const float* base = nullptr;
  int64_t n = 0;
  GemmOperand copy{static_cast<const float*>(nullptr)};
};
std::atomic<const WeightCopy*> g_weights{nullptr};

// x itself, or its place in the weights' bf16 copy when the whole stored
// matrix [rows, cols] (leading dimension ld) lies inside the weights.
GemmOperand in_weights(const GemmOperand& x, int64_t rows, int64_t cols, int64_t ld) {
  const WeightCopy* w = g_weights.load(std::memory_order_acquire);
  if (!w || !x.f32 || x.rounded) return x;
  // (Addresses compared as integers: x need not point into the weights.)
  const auto at = reinterpret_cast<uintptr_t>(x.f32), base = reinterpret_cast<uintptr_t>(w->base);
  if (at < base || (at - base) % sizeof(float) != 0) return x;
  const int64_t off = static_cast<int64_t>((at - base) / sizeof(float));
  return off + (rows - 1) * ld + cols <= w->n ? w->copy + off : x;
}

Matrix<float> rounded_values(const GemmOperand& x, int64_t rows, int64_t cols, int64_t ld, int which) {
  if (x.rounded) return {x.f32, ld};
  float* buf = operand_buffer<float>(which, rows * cols);
  if (x.bf16)
    for (int64_t r = 0; r < rows; ++r) bf16_to_f32_row(buf + r * cols, x.bf16 + r * ld, static_cast<size_t>(cols));
  else
    round_copy(buf, x.f32, rows, cols, ld);
  return {buf, cols};
}

Matrix<uint16_t> bf16_codes(const GemmOperand& x, int64_t rows, int64_t cols, int64_t ld, int which) {
  if (x.bf16) return {x.bf16, ld};
  uint16_t* buf = operand_buffer<uint16_t>(which, rows * cols);
  round_copy(buf, x.f32, rows, cols, ld);  // exact for values already rounded
  return {buf, cols};
}

}  // namespace

double set_gemm_bf16_min_primitive_work(double work) { return g_min_primitive_work.exchange(work); }

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda,
               GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // The stored operands: A is [ra, ca], B is [rb, cb].
  const int64_t ra = trans_a ? K : M, ca = trans_a ? M : K;
  const int64_t rb = trans_b ? N : K, cb = trans_b ? K : N;
  A = in_weights(A, ra, ca, lda);
  B = in_weights(B, rb, cb, ldb);
  const bool primitive = static_cast<double>(M) * N * K >= g_min_primitive_work.load() && bf16_dot_products();
  if (!primitive) {
    // The same rounding, then float32 arithmetic: the products of two bf16
    // values are exact in float32, so only the order of the sums can differ.
    const Matrix<float> a = rounded_values(A, ra, ca, lda, 0), b = rounded_values(B, rb, cb, ldb, 1);
    gemm_f32(trans_a, trans_b, M, N, K, alpha, a.data, a.ld, b.data, b.ld, beta, C, ldc);
    return;
  }
  const Matrix<uint16_t> a = bf16_codes(A, ra, ca, lda, 0), b = bf16_codes(B, rb, cb, ldb, 1);
  const auto block = gemm_block_shape(M, N, K, 0, kMinBlockWork);
  const int64_t bm = block.first, bn = block.second;
  const int64_t gm = (M + bm - 1) / bm, gn = (N + bn - 1) / bn;
  const int T = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), gm * gn));
  std::string failure;
  const auto run = [&](int64_t blk) {
    const int64_t m0 = blk / gn * bm, n0 = blk % gn * bn;
    const int64_t m1 = std::min(M, m0 + bm), n1 = std::min(N, n0 + bn);
    PrimitiveKey key{m1 - m0, n1 - n0, K, a.ld, b.ld, ldc, trans_a, trans_b, 0, 0};
    key.alpha = std::bit_cast<uint32_t>(alpha);
    key.beta = std::bit_cast<uint32_t>(beta);
    try {
      run_block(key, a.data + (trans_a ? m0 : m0 * a.ld), b.data + (trans_b ? n0 * b.ld : n0), C + m0 * ldc + n0);
    } catch (const std::exception& e) {  // (no exception may leave the parallel region)
#pragma omp critical(ds_gemm_bf16_failure)
      failure = e.what();
    }
  };
  if (T > 1) {
#pragma omp parallel for schedule(static) num_threads(T)
    for (int64_t blk = 0; blk < gm * gn; ++blk) run(blk);
  } else {
    // (No region: inside one, even a one-thread region costs libgomp a team.)
    for (int64_t blk = 0; blk < gm * gn; ++blk) run(blk);
  }
  DS_CHECK(failure.empty(), "gemm: the bf16 matmul failed (M={} N={} K={}): {}", M, N, K, failure);
}

}  // namespace ds::ops::detail

namespace ds::ops {

PreparedOperand::PreparedOperand(const float* src, int64_t n) : op_(src) {
  DS_CHECK(n >= 0, "PreparedOperand: negative size {}", n);
  if (gemm_dtype() != GemmDtype::kBf16 || n == 0) return;
  const bool codes = bf16_dot_products();
  if (codes)
    codes_.resize(static_cast<size_t>(n));
  else
    rounded_.resize(static_cast<size_t>(n));
  const auto part = [&](int64_t i0, int64_t i1) {
    if (codes)
      f32_to_bf16_row(codes_.data() + i0, src + i0, static_cast<size_t>(i1 - i0));
    else {
      std::memcpy(rounded_.data() + i0, src + i0, static_cast<size_t>(i1 - i0) * sizeof(float));
      round_to_bf16(rounded_.data() + i0, static_cast<size_t>(i1 - i0));
    }
  };
  parallel_ranges(n, !omp_in_parallel() && n >= (1 << 16), part);
  op_ = codes ? GemmOperand(codes_.data()) : GemmOperand(rounded_.data(), true);
}

ScopedBf16Weights::ScopedBf16Weights(const float* base, int64_t n) {
  if (gemm_dtype() != GemmDtype::kBf16 || n <= 0) return;
  DS_CHECK(detail::g_weights.load() == nullptr, "ScopedBf16Weights: another one is alive");
  copy_ = std::make_unique<PreparedOperand>(base, n);
  auto* w = new detail::WeightCopy{base, n, copy_->operand()};
  detail::g_weights.store(w, std::memory_order_release);
}

ScopedBf16Weights::~ScopedBf16Weights() {
  if (copy_) delete detail::g_weights.exchange(nullptr);
}

}  // namespace ds::ops
