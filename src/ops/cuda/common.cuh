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

// The ops (elementwise.cu, linear.cu, latent_attention.cu).
DS_BACKEND_OPS_DECLARED

}  // namespace ds::ops::cuda
