// Shared by the CUDA backend's sources: error checks and launch helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ops/backend.h"

namespace ds::ops::cuda {

// Any CUDA error becomes one ds::Error naming the call and the place.
[[noreturn]] inline void fail(const char* call, const char* what, const char* file, int line) {
  backend_error(std::string("CUDA: ") + call + " failed: " + what + " (" + file + ":" + std::to_string(line) + ")");
}

#define DS_CUDA(call)                                                                                          \
  do {                                                                                                         \
    const cudaError_t ds_err_ = (call);                                                                        \
    if (ds_err_ != cudaSuccess) ::ds::ops::cuda::fail(#call, cudaGetErrorString(ds_err_), __FILE__, __LINE__); \
  } while (0)

// After a launch: a bad configuration shows at once, a fault at the next sync.
#define DS_CUDA_LAUNCHED() DS_CUDA(cudaGetLastError())

#define DS_CUDA_REQUIRE(cond, msg)                                        \
  do {                                                                    \
    if (!(cond)) ::ds::ops::cuda::fail(#cond, (msg), __FILE__, __LINE__); \
  } while (0)

// The stream every op of this backend runs on, in order (the legacy default
// stream: host code that copies or synchronizes sees all earlier work done).
inline cudaStream_t stream() { return 0; }

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > (int64_t{1} << 30) ? (int64_t{1} << 30) : b));
}

// Scratch device memory that grows and is kept between calls (one per use).
// Shared by every caller: the CUDA entries expect one host thread at a time,
// as their stream orders them anyway.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  void* get(size_t need) {
    if (need > bytes) {
      if (ptr) DS_CUDA(cudaFree(ptr));
      ptr = nullptr;
      DS_CUDA(cudaMalloc(&ptr, need));
      bytes = need;
    }
    return ptr;
  }
};

// The ops (elementwise.cu, linear.cu).
void linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                    bool accumulate);
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps);
void silu_mul_forward(float* out, const float* a, const float* b, int64_t n, float limit);
void sigmoid_forward(float* y, const float* x, int64_t n);
void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols);
void rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens, int64_t heads,
                  int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout);
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab, int64_t dim);
void latent_attention_forward(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc, const float* absorbed,
                              const LatentAttentionDims& d);

}  // namespace ds::ops::cuda
