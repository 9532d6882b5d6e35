// Dense matrix products, row-major float32.
//
// gemm() is the one entry point to the BLAS (oneDNN's sgemm, which picks its
// kernels from the CPU's features at run time). Called from inside an OpenMP
// parallel region it runs on the calling thread only, which is how the tiled
// kernels (attention, grouped matmul) use it.
//
// Its arithmetic is gemm_dtype() (MaxText's `dtype`), process-wide:
//   kF32   float32 products and sums (the default);
//   kBf16  A and B rounded to the nearest bf16 (ties to even), products
//          summed in float32: a bf16 matmul with float32 accumulation, as
//          MaxText's dtype=bfloat16 and PyTorch's autocast run it. Where the
//          CPU has AVX512-BF16 (and core/simd.h's cap allows it) the rounded
//          operands are multiplied by oneDNN's bf16 matmul (vdpbf16ps, twice
//          the FMA rate; it treats subnormal bf16 inputs as zero); elsewhere
//          sgemm multiplies the rounded values: the same products, float32
//          speed. Either way C depends on the shape and data alone, never on
//          the thread count.
// The setting is process-wide rather than per thread so that the worker
// threads of a parallel region see what the thread that drives the model set
// (ScopedGemmDtype); only that one thread may change it, between ops.
//
// matmul: C[M,N] = op(A) op(B), op(A) [M,K], op(B) [K,N]; A is [M,K] or, when
// trans_a, [K,M]; B is [K,N] or, when trans_b, [N,K] (a Hugging Face Linear
// weight [out, in] is used as B with trans_b).
//   dA = dC op(B)^T   (activation gradient: overwritten, `=`)
//   dB = op(A)^T dC   (weight gradient: accumulated, `+=`)
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "core/buffer.h"

namespace ds::ops {

enum class GemmDtype { kF32, kBf16 };
void set_gemm_dtype(GemmDtype t);
GemmDtype gemm_dtype();
// "float32" / "bfloat16" (MaxText's names); anything else throws ds::Error.
GemmDtype parse_gemm_dtype(std::string_view name);
std::string_view gemm_dtype_name(GemmDtype t);

// Sets gemm_dtype() while alive, restoring the previous one after.
class ScopedGemmDtype {
 public:
  explicit ScopedGemmDtype(GemmDtype t) : saved_(gemm_dtype()) { set_gemm_dtype(t); }
  ~ScopedGemmDtype() { set_gemm_dtype(saved_); }
  ScopedGemmDtype(const ScopedGemmDtype&) = delete;
  ScopedGemmDtype& operator=(const ScopedGemmDtype&) = delete;

 private:
  GemmDtype saved_;
};

// One operand of gemm: float32 values (a plain pointer converts to it), or,
// prepared once by PreparedOperand under gemm_dtype() bf16, the same matrix
// as bf16 codes or as float32 values already rounded to bf16.
struct GemmOperand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  bool rounded = false;  // f32 holds bf16 values: gemm need not round them again

  GemmOperand(const float* values) : f32(values) {}  // NOLINT(google-explicit-constructor)
  GemmOperand(const float* values, bool already_rounded) : f32(values), rounded(already_rounded) {}
  explicit GemmOperand(const uint16_t* codes) : bf16(codes) {}
  // The operand from element `offset` on (a block of the matrix).
  GemmOperand operator+(int64_t offset) const {
    GemmOperand o = *this;
    if (o.f32) o.f32 += offset;
    if (o.bf16) o.bf16 += offset;
    return o;
  }
};

// A matrix that an op multiplies in many parts (the LM head's weight once per
// block of tokens, an expert's weights once per tile of its rows), converted
// once for gemm_dtype(): in float32 it is the matrix itself; in bf16 it is
// the matrix rounded to bf16 (codes where the CPU has bf16 dot products,
// float32 values elsewhere) in the same layout, so an element offset into
// the source is the same offset into operand(). Make it where gemm_dtype()
// is the one the products run under; inside a parallel region it converts
// on the calling thread alone.
class PreparedOperand {
 public:
  // The n elements at src (a whole matrix, leading dimension included).
  PreparedOperand(const float* src, int64_t n);
  const GemmOperand& operand() const { return op_; }

 private:
  Buffer<float> rounded_;
  Buffer<uint16_t> codes_;
  GemmOperand op_;
};

// The model's weights in bf16, converted once per step rather than once per
// product: while one is alive (and gemm_dtype() is bf16), a gemm operand
// that lies inside [base, base + n) is read from this copy instead, as
// MaxText casts its float32 parameters to dtype once per step. The memory
// must not change while it is alive (the trainer makes one per step, after
// the optimizer's update). One at a time; in float32 it does nothing.
class ScopedBf16Weights {
 public:
  ScopedBf16Weights(const float* base, int64_t n);
  ~ScopedBf16Weights();
  ScopedBf16Weights(const ScopedBf16Weights&) = delete;
  ScopedBf16Weights& operator=(const ScopedBf16Weights&) = delete;

 private:
  std::unique_ptr<PreparedOperand> copy_;
};

namespace detail {
// For tests: the number of multiply-adds from which a bf16 product runs on
// oneDNN's bf16 matmul where the CPU has bf16 dot products (smaller ones run
// on sgemm over the rounded values); returns the previous value.
double set_gemm_bf16_min_primitive_work(double work);
}  // namespace detail

// C = alpha * op(A) op(B) + beta * C with explicit leading dimensions.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda,
          GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc);

void matmul_forward(float* c, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool trans_a = false,
                    bool trans_b = false);
// da (may be null) is overwritten; db (may be null) is accumulated into.
void matmul_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t M, int64_t N,
                     int64_t K, bool trans_a = false, bool trans_b = false);

// Batched: `batch` independent products with element strides between batches
// (a stride of 0 broadcasts that operand).
void matmul_batched_forward(float* c, const float* a, const float* b, int64_t batch, int64_t M, int64_t N, int64_t K,
                            int64_t stride_a, int64_t stride_b, int64_t stride_c, bool trans_a = false,
                            bool trans_b = false);
// da is overwritten; db is accumulated (over the batch too when stride_b is 0).
// A broadcast a (stride_a 0) gets the sum of its gradients over the batch.
void matmul_batched_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t batch,
                             int64_t M, int64_t N, int64_t K, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                             bool trans_a = false, bool trans_b = false);

}  // namespace ds::ops
