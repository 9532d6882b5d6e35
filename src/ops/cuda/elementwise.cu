// The CUDA backend's row and elementwise ops: RMSNorm, SwiGLU's silu(a) * b,
// sigmoid, softmax, rotary embedding and the embedding lookup. Each follows
// its CPU op's contract (ops/*.h) and its arithmetic where that decides the
// bits: RMSNorm sums squares in double, rope takes cos and sin of the float32
// angle in double, softmax gives a fully masked row zeros.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cuda/common.cuh"

namespace ds::ops::cuda {
namespace {

constexpr int kRowThreads = 256;

template <typename T>
__device__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The block's sum of v (every thread gets it). kRowThreads threads.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T part[kRowThreads / 32];
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // part[] may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  T s = 0;
  for (int i = 0; i < kRowThreads / 32; ++i) s += part[i];
  return s;
}
__device__ float block_max(float v) {
  __shared__ float part[kRowThreads / 32];
  v = warp_max(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int i = 0; i < kRowThreads / 32; ++i) m = fmaxf(m, part[i]);
  return m;
}

__global__ void rmsnorm_kernel(float* y, float* rstd, const float* x, const float* w, int64_t dim, float eps) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < dim; j += kRowThreads) ss += static_cast<double>(xr[j]) * xr[j];
  ss = block_sum(ss);
  const float rs = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(dim) + eps));
  if (threadIdx.x == 0) rstd[r] = rs;
  float* yr = y + r * dim;
  for (int64_t j = threadIdx.x; j < dim; j += kRowThreads) yr[j] = xr[j] * rs * w[j];
}

// sigmoid without overflow, as the CPU's: 1 / (1 + e) or e / (1 + e), e = exp(-|x|).
__device__ float sigmoid(float x) {
  const float e = expf(-fabsf(x));
  return (x < 0 ? e : 1.0f) / (1.0f + e);
}

__device__ float silu_mul(float x, float v, float limit) {
  if (limit > 0) {
    x = fminf(x, limit);
    v = fminf(fmaxf(v, -limit), limit);
  }
  return x * sigmoid(x) * v;
}

__global__ void silu_mul_kernel(float* out, const float* a, const float* b, int64_t n, float limit) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = silu_mul(a[i], b[i], limit);
}

// The same four elements at a time: 16-byte loads and stores.
__global__ void silu_mul_kernel4(float4* out, const float4* a, const float4* b, int64_t n4, float limit) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4; i += int64_t{gridDim.x} * blockDim.x) {
    const float4 x = a[i], v = b[i];
    out[i] = make_float4(silu_mul(x.x, v.x, limit), silu_mul(x.y, v.y, limit), silu_mul(x.z, v.z, limit),
                         silu_mul(x.w, v.w, limit));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__global__ void sigmoid_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] = sigmoid(x[i]);
}

// Softmax over rows of any length on all multiprocessors: a row is cut into
// chunks of kSoftmaxChunk columns, one block each. softmax_partials writes
// each chunk's max m_c and sum of exp(x - m_c) (in double); softmax_scale
// combines a row's partials into the row's max M and sum S = sum_c s_c
// exp(m_c - M) and writes exp(x - M) / S. A fully masked row (M = -inf)
// gives zeros, as on the CPU. Three passes over x and y instead of five.
constexpr int64_t kSoftmaxChunk = 4096;

struct SoftmaxPartial {
  float max;
  double sum;
};

__global__ void softmax_partials(SoftmaxPartial* part, const float* x, int64_t cols, int64_t chunks) {
  const int64_t r = blockIdx.y, c = blockIdx.x;
  const int64_t j0 = c * kSoftmaxChunk, j1 = min(cols, j0 + kSoftmaxChunk);
  const float* xr = x + r * cols;
  float m = -INFINITY;
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kRowThreads) m = fmaxf(m, xr[j]);
  m = block_max(m);
  const float shift = m == -INFINITY ? 0.0f : m;
  double s = 0;
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kRowThreads) s += expf(xr[j] - shift);
  s = block_sum(s);
  if (threadIdx.x == 0) part[r * chunks + c] = {m, s};
}

__global__ void softmax_scale(float* y, const float* x, const SoftmaxPartial* part, int64_t cols, int64_t chunks) {
  const int64_t r = blockIdx.y, c = blockIdx.x;
  const SoftmaxPartial* pr = part + r * chunks;
  float m = -INFINITY;
  for (int64_t i = 0; i < chunks; ++i) m = fmaxf(m, pr[i].max);
  double s = 0;
  if (m != -INFINITY)
    for (int64_t i = 0; i < chunks; ++i)
      if (pr[i].max != -INFINITY) s += pr[i].sum * exp(static_cast<double>(pr[i].max) - m);
  const float shift = m == -INFINITY ? 0.0f : m;
  const float scale = s > 0 ? static_cast<float>(1.0 / s) : 0.0f;
  const int64_t j0 = c * kSoftmaxChunk, j1 = min(cols, j0 + kSoftmaxChunk);
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kRowThreads) y[r * cols + j] = expf(x[r * cols + j] - shift) * scale;
}

// One thread per (token, head, pair).
__global__ void rope_kernel(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens,
                            int64_t heads, int64_t half, int64_t token_stride, int64_t head_stride, bool interleaved) {
  const int64_t n = tokens * heads * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = i % half, h = (i / half) % heads, t = i / (half * heads);
    const double angle = static_cast<double>(static_cast<float>(positions[t]) * freqs[p]);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    const int64_t base = t * token_stride + h * head_stride;
    const int64_t ia = base + (interleaved ? 2 * p : p), ib = base + (interleaved ? 2 * p + 1 : p + half);
    const float a = x[ia], b = x[ib];
    y[ia] = a * c - b * s;
    y[ib] = b * c + a * s;
  }
}

// The first bad id's token, or -1: atomicMin over tokens that fail.
__global__ void check_ids_kernel(int64_t* first_bad, const int32_t* ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < tokens; t += int64_t{gridDim.x} * blockDim.x)
    if (ids[t] < 0 || ids[t] >= vocab)
      atomicMin(reinterpret_cast<unsigned long long*>(first_bad), static_cast<unsigned long long>(t));
}

__global__ void embedding_kernel(float* out, const int32_t* ids, const float* table, int64_t dim) {
  const int64_t t = blockIdx.x;
  const float* row = table + static_cast<int64_t>(ids[t]) * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) out[t * dim + j] = row[j];
}

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps) {
  DS_CUDA_REQUIRE(rows >= 0 && dim > 0, ("rmsnorm: rows=" + str(rows) + " dim=" + str(dim)).c_str());
  DS_CUDA_REQUIRE(eps >= 0, "rmsnorm: eps must be non-negative");
  if (rows == 0) return;
  rmsnorm_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream()>>>(y, rstd, x, w, dim, eps);
  DS_CUDA_LAUNCHED();
}

void silu_mul_forward(float* out, const float* a, const float* b, int64_t n, float limit) {
  DS_CUDA_REQUIRE(n >= 0 && limit >= 0, ("silu_mul: n=" + str(n)).c_str());
  if (n == 0) return;
  if (n % 4 == 0 && aligned16(out) && aligned16(a) && aligned16(b))
    silu_mul_kernel4<<<blocks_for(n / 4, 256), 256, 0, stream()>>>(reinterpret_cast<float4*>(out),
                                                                   reinterpret_cast<const float4*>(a),
                                                                   reinterpret_cast<const float4*>(b), n / 4, limit);
  else
    silu_mul_kernel<<<blocks_for(n, 256), 256, 0, stream()>>>(out, a, b, n, limit);
  DS_CUDA_LAUNCHED();
}

void sigmoid_forward(float* y, const float* x, int64_t n) {
  DS_CUDA_REQUIRE(n >= 0, ("sigmoid: n=" + str(n)).c_str());
  if (n == 0) return;
  sigmoid_kernel<<<blocks_for(n, 256), 256, 0, stream()>>>(y, x, n);
  DS_CUDA_LAUNCHED();
}

void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols) {
  DS_CUDA_REQUIRE(rows >= 0 && cols > 0, ("softmax: rows=" + str(rows) + " cols=" + str(cols)).c_str());
  if (rows == 0) return;
  const int64_t chunks = (cols + kSoftmaxChunk - 1) / kSoftmaxChunk;
  constexpr int64_t kMaxGridY = 65535;  // rows per launch
  static Scratch partials;
  auto* part = static_cast<SoftmaxPartial*>(
      partials.get(static_cast<size_t>(std::min(rows, kMaxGridY) * chunks) * sizeof(SoftmaxPartial)));
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGridY) {
    const int64_t n = std::min(rows - r0, kMaxGridY);
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(n));
    softmax_partials<<<grid, kRowThreads, 0, stream()>>>(part, x + r0 * cols, cols, chunks);
    DS_CUDA_LAUNCHED();
    softmax_scale<<<grid, kRowThreads, 0, stream()>>>(y + r0 * cols, x + r0 * cols, part, cols, chunks);
    DS_CUDA_LAUNCHED();
  }
}

void rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens, int64_t heads,
                  int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  DS_CUDA_REQUIRE(dim > 0 && dim % 2 == 0,
                  ("rope_forward: rotary dim must be positive and even, got " + str(dim)).c_str());
  DS_CUDA_REQUIRE(tokens >= 0 && heads >= 0, "rope_forward: negative tokens or heads");
  DS_CUDA_REQUIRE(heads <= 1 || head_stride >= dim, "rope_forward: head_stride < dim");
  DS_CUDA_REQUIRE(tokens <= 1 || token_stride >= dim, "rope_forward: token_stride < dim");
  const int64_t n = tokens * heads * (dim / 2);
  if (n == 0) return;
  // Positions are device memory and, unlike the CPU op, are not checked for
  // being negative here (that would cost a synchronization per call).
  rope_kernel<<<blocks_for(n, 256), 256, 0, stream()>>>(y, x, positions, freqs, tokens, heads, dim / 2, token_stride,
                                                        head_stride, layout == RopeLayout::Interleaved);
  DS_CUDA_LAUNCHED();
}

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab, int64_t dim) {
  DS_CUDA_REQUIRE(tokens >= 0 && vocab > 0 && dim > 0,
                  ("embedding: tokens=" + str(tokens) + " vocab=" + str(vocab) + " dim=" + str(dim)).c_str());
  if (tokens == 0) return;
  // Every id is checked before anything is written, as on the CPU.
  static Scratch flag;
  auto* first_bad = static_cast<int64_t*>(flag.get(sizeof(int64_t)));
  const int64_t none = INT64_MAX;
  DS_CUDA(cudaMemcpyAsync(first_bad, &none, sizeof none, cudaMemcpyHostToDevice, stream()));
  check_ids_kernel<<<blocks_for(tokens, 256), 256, 0, stream()>>>(first_bad, ids, tokens, vocab);
  DS_CUDA_LAUNCHED();
  int64_t bad = 0;
  DS_CUDA(cudaMemcpy(&bad, first_bad, sizeof bad, cudaMemcpyDeviceToHost));
  if (bad != INT64_MAX) {
    int32_t id = 0;
    DS_CUDA(cudaMemcpy(&id, ids + bad, sizeof id, cudaMemcpyDeviceToHost));
    backend_error("embedding: token " + str(bad) + " has id " + std::to_string(id) + " outside the vocabulary [0, " +
                  str(vocab) + ")");
  }
  embedding_kernel<<<static_cast<unsigned>(tokens), 128, 0, stream()>>>(out, ids, table, dim);
  DS_CUDA_LAUNCHED();
}

}  // namespace ds::ops::cuda
