// The backend table and the ops' entry points, which forward to the active
// backend (ops/backend.h).
#include "ops/backend.h"

#include <atomic>
#include <cstring>
#include <new>

#include "core/error.h"
#include "ops/activations.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"

namespace ds::ops {

namespace {

std::atomic<const Backend*> g_active{nullptr};

// Host memory for the CPU table: 64-byte aligned, as Tensor's.
void* host_alloc(size_t bytes) {
  void* p = ::operator new (bytes ? bytes : 1, std::align_val_t{64});
  return p;
}
void host_free(void* p) {
  if (p) ::operator delete (p, std::align_val_t{64});
}
void host_copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void host_synchronize() {}

struct CudaProbe {
  const Backend* backend = nullptr;
  std::string why;
};

const CudaProbe& cuda_probe() {
  static const CudaProbe probe = [] {
    CudaProbe p;
#ifdef DEEPSEEK_HAVE_CUDA
    try {
      p.backend = cuda::make_backend(&p.why);
    } catch (const std::exception& e) {
      p.why = e.what();
    }
    if (p.backend) p.why = "available";
#else
    p.why = "this build has no CUDA backend (configure with -DDEEPSEEK_CUDA=ON)";
#endif
    return p;
  }();
  return probe;
}

}  // namespace

const Backend& cpu_backend() {
  static const Backend table = [] {
    Backend b;
    b.device = Device::CPU;
    b.name = "cpu";
    b.alloc = host_alloc;
    b.free = host_free;
    b.upload = host_copy;
    b.download = host_copy;
    b.copy = host_copy;
    b.synchronize = host_synchronize;
    b.linear_forward = cpu::linear_forward;
    b.rmsnorm_forward = cpu::rmsnorm_forward;
    b.silu_mul_forward = cpu::silu_mul_forward;
    b.sigmoid_forward = cpu::sigmoid_forward;
    b.softmax_forward = cpu::softmax_forward;
    b.rope_forward = cpu::rope_forward;
    b.embedding_forward = cpu::embedding_forward;
    b.latent_attention_forward = cpu::latent_attention_forward;
    return b;
  }();
  return table;
}

const Backend* cuda_backend() { return cuda_probe().backend; }
std::string cuda_status() { return cuda_probe().why; }

const Backend& backend_for(Device d) {
  if (d == Device::CPU) return cpu_backend();
  const Backend* b = cuda_backend();
  DS_CHECK(b != nullptr, "no CUDA backend: {}", cuda_status());
  return *b;
}

const Backend& active_backend() {
  const Backend* b = g_active.load(std::memory_order_relaxed);
  return b ? *b : cpu_backend();
}

void set_active_backend(const Backend& b) { g_active.store(&b, std::memory_order_relaxed); }

void backend_error(const std::string& what) { throw Error(what); }

// The ops' entry points.
void linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                    bool accumulate) {
  active_backend().linear_forward(y, x, w, M, ldx, ldy, accumulate);
}
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps) {
  active_backend().rmsnorm_forward(y, rstd, x, w, rows, dim, eps);
}
void silu_mul_forward(float* out, const float* a, const float* b, int64_t n, float limit) {
  active_backend().silu_mul_forward(out, a, b, n, limit);
}
void sigmoid_forward(float* y, const float* x, int64_t n) { active_backend().sigmoid_forward(y, x, n); }
void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols) {
  active_backend().softmax_forward(y, x, rows, cols);
}
void rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens, int64_t heads,
                  int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  active_backend().rope_forward(y, x, positions, freqs, tokens, heads, dim, token_stride, head_stride, layout);
}
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab, int64_t dim) {
  active_backend().embedding_forward(out, ids, table, tokens, vocab, dim);
}
void latent_attention_forward(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc, const float* absorbed,
                              const LatentAttentionDims& d) {
  active_backend().latent_attention_forward(seqs, count, ldq, ldc, absorbed, d);
}

}  // namespace ds::ops
