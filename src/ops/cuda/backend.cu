// The CUDA backend's table: memory, copies, and the ops of ops/cuda/.
#include <cuda_runtime.h>

#include <string>

#include "ops/cuda/common.cuh"

namespace ds::ops::cuda {
namespace {

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  DS_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}
void device_free(void* p) {
  if (p) DS_CUDA(cudaFree(p));
}
void upload(void* dst, const void* src, size_t bytes) {
  if (bytes) DS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void download(void* dst, const void* src, size_t bytes) {
  if (bytes) DS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes) DS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
void synchronize() { DS_CUDA(cudaDeviceSynchronize()); }

}  // namespace

const Backend* make_backend(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *why = std::string(err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice ? "no NVIDIA GPU or driver found"
                                                                                      : "no usable CUDA device") +
           " (" + cudaGetErrorString(err) + ")";
    return nullptr;
  }
  if (count == 0) {
    *why = "no CUDA device";
    return nullptr;
  }
  cudaDeviceProp prop{};
  DS_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    *why = std::string("device 0 (") + prop.name + ") is compute capability " + std::to_string(prop.major) + "." +
           std::to_string(prop.minor) + "; this build's kernels are for 9.0 (sm_90a)";
    return nullptr;
  }
  static const Backend table = [] {
    Backend b;
    b.device = Device::CUDA;
    b.name = "cuda";
    b.alloc = device_alloc;
    b.free = device_free;
    b.upload = upload;
    b.download = download;
    b.copy = copy;
    b.synchronize = synchronize;
    b.linear_forward = linear_forward;
    b.rmsnorm_forward = rmsnorm_forward;
    b.silu_mul_forward = silu_mul_forward;
    b.sigmoid_forward = sigmoid_forward;
    b.softmax_forward = softmax_forward;
    b.rope_forward = rope_forward;
    b.embedding_forward = embedding_forward;
    b.latent_attention_forward = latent_attention_forward;
    return b;
  }();
  return &table;
}

}  // namespace ds::ops::cuda
