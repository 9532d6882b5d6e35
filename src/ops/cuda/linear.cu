// linear_forward on the GPU: y[M, out] = x[M, in] @ W[out, in]^T (ops/linear.h).
//
// bf16 weights under bf16 precision (x rounded to bf16, float32 sums, as the
// CPU's MatmulPrecision::kBf16) go straight to cuBLASLt on the tensor cores.
// Every other weight dtype the CPU takes in floating point (float32, f16,
// bf16 under float32 precision, block-scaled e4m3 and e5m2) is widened to
// float32 into a scratch buffer first and multiplied by cuBLASLt in strict
// float32 (CUBLAS_COMPUTE_32F, no TF32): exact to the CPU's semantics up to
// the order of sums, and slower than a kernel that widens per tile, which is
// still to come. Packed fp4 and the block formats (q4_k, ...) have no CUDA
// kernel yet and are refused with an error.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "ops/cuda/common.cuh"

namespace ds::ops::cuda {
namespace {

void lt_check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(call, cublasLtGetStatusString(s), file, line);
}
#define DS_LT(call) lt_check((call), #call, __FILE__, __LINE__)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

struct Lt {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  // Heuristic choices by (A/B type, m, n, k, ldb, ldc, alignments).
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int>, cublasLtMatmulAlgo_t> algos;
  std::mutex mu;
};

Lt& lt() {
  static Lt* state = [] {
    auto* s = new Lt;
    DS_LT(cublasLtCreate(&s->handle));
    DS_CUDA(cudaMalloc(&s->workspace, kWorkspaceBytes));
    return s;
  }();
  return *state;
}

int alignment_class(const void* p, int64_t ld, size_t elem) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return (a % 16 == 0 && (ld * elem) % 16 == 0) ? 1 : 0;
}

// C[m, n] (column-major, ldc) = alpha * A^T B + beta * C with A [k, m]
// (column-major, lda = k: W's rows) and B [k, n] (ldb: x's rows), both of
// type `ab`; C float32; float32 accumulation.
void lt_matmul(cudaDataType_t ab, const void* A, const void* B, int64_t ldb, float* C, int64_t ldc, int64_t m,
               int64_t n, int64_t k, float beta) {
  Lt& s = lt();
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a_l = nullptr, b_l = nullptr, c_l = nullptr;
  DS_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  DS_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a));
  DS_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b));
  DS_LT(cublasLtMatrixLayoutCreate(&a_l, ab, k, m, k));
  DS_LT(cublasLtMatrixLayoutCreate(&b_l, ab, k, n, ldb));
  DS_LT(cublasLtMatrixLayoutCreate(&c_l, CUDA_R_32F, m, n, ldc));
  const size_t elem = ab == CUDA_R_32F ? 4 : 2;
  const int align = alignment_class(A, k, elem) | alignment_class(B, ldb, elem) << 1 | alignment_class(C, ldc, 4) << 2;
  const auto key = std::make_tuple(static_cast<int>(ab), m, n, k, ldb, ldc, align);
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.algos.find(key);
    if (it == s.algos.end()) {
      cublasLtMatmulPreference_t pref = nullptr;
      DS_LT(cublasLtMatmulPreferenceCreate(&pref));
      DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
                                                 sizeof kWorkspaceBytes));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      DS_LT(cublasLtMatmulAlgoGetHeuristic(s.handle, desc, a_l, b_l, c_l, c_l, pref, 1, &result, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      DS_CUDA_REQUIRE(found > 0, "cuBLASLt has no algorithm for this product");
      it = s.algos.emplace(key, result.algo).first;
    }
    algo = it->second;
  }
  const float alpha = 1.0f;
  DS_LT(cublasLtMatmul(s.handle, desc, &alpha, A, a_l, B, b_l, &beta, C, c_l, C, c_l, &algo, s.workspace,
                       kWorkspaceBytes, stream()));
  cublasLtMatrixLayoutDestroy(a_l);
  cublasLtMatrixLayoutDestroy(b_l);
  cublasLtMatrixLayoutDestroy(c_l);
  cublasLtMatmulDescDestroy(desc);
}

// x [M, cols] (row stride ldx) rounded to the nearest bf16, packed.
__global__ void x_to_bf16(__nv_bfloat16* out, const float* x, int64_t M, int64_t cols, int64_t ldx) {
  const int64_t n = M * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(x[(i / cols) * ldx + i % cols]);
}

// The same, kept in float32 (the bf16 value widened back, exactly).
__global__ void x_round_bf16(float* out, const float* x, int64_t M, int64_t cols, int64_t ldx) {
  const int64_t n = M * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __bfloat162float(__float2bfloat16_rn(x[(i / cols) * ldx + i % cols]));
}

// W widened to float32 [rows, cols]: W[r, c] = code[r, c] * s[r / br, c / bc]
// for fp8 (s = 1 for the others).
__global__ void widen_kernel(float* out, const void* data, int dtype, int64_t rows, int64_t cols,
                             const float* scale_inv, int64_t br, int64_t bc) {
  const int64_t n = rows * cols;
  const int64_t scale_cols = bc > 0 ? (cols + bc - 1) / bc : 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float v;
    switch (dtype) {
      case static_cast<int>(DType::BF16):
        v = __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
        break;
      case static_cast<int>(DType::F16):
        v = __half2float(static_cast<const __half*>(data)[i]);
        break;
      case static_cast<int>(DType::F8E4M3): {
        __nv_fp8_e4m3 q;
        q.__x = static_cast<const __nv_fp8_storage_t*>(data)[i];
        v = static_cast<float>(q);
        break;
      }
      case static_cast<int>(DType::F8E5M2): {
        __nv_fp8_e5m2 q;
        q.__x = static_cast<const __nv_fp8_storage_t*>(data)[i];
        v = static_cast<float>(q);
        break;
      }
      default:
        v = static_cast<const float*>(data)[i];
    }
    if (scale_inv) v *= scale_inv[(i / cols) / br * scale_cols + (i % cols) / bc];
    out[i] = v;
  }
}

// Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on
// "[" + std::to_string(...) in this file.
std::string shape(const WeightView& w) {
  std::string s = "[";
  s += std::to_string(w.rows);
  s += ", ";
  s += std::to_string(w.cols);
  s += "]";
  return s;
}

}  // namespace

void linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                    bool accumulate) {
  DS_CUDA_REQUIRE(w.data != nullptr && w.rows > 0 && w.cols > 0, ("linear: empty weight " + shape(w)).c_str());
  DS_CUDA_REQUIRE(M >= 0 && ldx >= w.cols && ldy >= w.rows,
                  ("linear: M, ldx or ldy too small for weight " + shape(w)).c_str());
  const bool fp8 = w.dtype == DType::F8E4M3 || w.dtype == DType::F8E5M2;
  const bool floating = w.dtype == DType::F32 || w.dtype == DType::BF16 || w.dtype == DType::F16 || fp8;
  if (!floating)
    backend_error("linear: " + std::string(dtype_name(w.dtype)) + " weights have no CUDA kernel yet (weight " +
                  shape(w) + ")");
  DS_CUDA_REQUIRE(!fp8 || (w.scale_inv != nullptr && w.block_rows > 0 && w.block_cols > 0),
                  ("linear: fp8 weight " + shape(w) + " needs its block scale_inv").c_str());
  if (M == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  const bool bf16 = matmul_precision() == MatmulPrecision::kBf16;
  if (w.dtype == DType::BF16 && bf16) {
    static Scratch xs;
    auto* xb = static_cast<__nv_bfloat16*>(xs.get(static_cast<size_t>(M * w.cols) * sizeof(__nv_bfloat16)));
    x_to_bf16<<<blocks_for(M * w.cols, 256), 256, 0, stream()>>>(xb, x, M, w.cols, ldx);
    DS_CUDA_LAUNCHED();
    lt_matmul(CUDA_R_16BF, w.data, xb, w.cols, y, ldy, w.rows, M, w.cols, beta);
    return;
  }
  const float* wf = static_cast<const float*>(w.data);
  if (w.dtype != DType::F32 || w.scale_inv != nullptr) {
    static Scratch ws;
    auto* wide = static_cast<float*>(ws.get(static_cast<size_t>(w.rows * w.cols) * sizeof(float)));
    widen_kernel<<<blocks_for(w.rows * w.cols, 256), 256, 0, stream()>>>(wide, w.data, static_cast<int>(w.dtype),
                                                                         w.rows, w.cols, fp8 ? w.scale_inv : nullptr,
                                                                         w.block_rows, w.block_cols);
    DS_CUDA_LAUNCHED();
    wf = wide;
  }
  if (bf16 && w.dtype != DType::F32) {
    // The CPU's bf16 precision rounds x for every narrow weight.
    static Scratch xs;
    auto* xr = static_cast<float*>(xs.get(static_cast<size_t>(M * w.cols) * sizeof(float)));
    x_round_bf16<<<blocks_for(M * w.cols, 256), 256, 0, stream()>>>(xr, x, M, w.cols, ldx);
    DS_CUDA_LAUNCHED();
    x = xr;
    ldx = w.cols;
  }
  lt_matmul(CUDA_R_32F, wf, x, ldx, y, ldy, w.rows, M, w.cols, beta);
}

}  // namespace ds::ops::cuda
