// The backend table: where the ops run.
//
// Every op named in `Backend` is called as before (ops::rmsnorm_forward, ...)
// and forwards to the active backend's entry, so the stage functions, and with
// them inference, training and every schedule, stay one code for every
// device (ggml's idea: one table per backend, one folder of kernels each,
// ops/cpu/ and ops/cuda/). The CPU backend is active unless a program selects
// another; while another is active, the pointers given to these ops must be
// that device's memory (Backend::alloc).
//
// The CUDA backend exists when the build has -DDEEPSEEK_CUDA=ON and the
// process sees a usable GPU; ops/cuda/ holds its kernels. Which of its entries
// have run on a GPU, and against what, is written in README.md ("CUDA"); its
// entries expect one host thread at a time.
// tests/backend_ops_test.cc checks every entry of every backend present
// against the CPU's on random inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"
#include "ops/rope.h"

namespace ds::ops {

// The ops' signatures, once: the same arguments and meaning as their
// functions in ops/*.h. Each backend declares its kernels with them
// (`OpLinearForward linear_forward;` declares a function).
using OpLinearForward = void(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                             bool accumulate);
using OpRmsnormForward = void(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim,
                              float eps);
using OpSiluMulForward = void(float* out, const float* a, const float* b, int64_t n, float limit);
using OpSigmoidForward = void(float* y, const float* x, int64_t n);
using OpSoftmaxForward = void(float* y, const float* x, int64_t rows, int64_t cols);
using OpRopeForward = void(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens,
                           int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout);
using OpEmbeddingForward = void(float* out, const int32_t* ids, const float* table, int64_t tokens, int64_t vocab,
                                int64_t dim);
// The sequences' descriptors are host memory; what they point to (and
// `absorbed`) the device's.
using OpLatentAttentionForward = void(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc,
                                      const float* absorbed, const LatentAttentionDims& d);

// Declares a backend's kernels, one per op, in the namespace where it is
// written (ops::cpu, ops::cuda).
#define DS_BACKEND_OPS_DECLARED         \
  OpLinearForward linear_forward;       \
  OpRmsnormForward rmsnorm_forward;     \
  OpSiluMulForward silu_mul_forward;    \
  OpSigmoidForward sigmoid_forward;     \
  OpSoftmaxForward softmax_forward;     \
  OpRopeForward rope_forward;           \
  OpEmbeddingForward embedding_forward; \
  OpLatentAttentionForward latent_attention_forward;

struct Backend {
  Device device = Device::CPU;
  const char* name = "cpu";

  // Memory on the backend's device. alloc never returns null (it throws);
  // free(nullptr) does nothing. upload copies host -> device, download
  // device -> host, copy device -> device; all three are complete on return.
  void* (*alloc)(size_t bytes) = nullptr;
  void (*free)(void* p) = nullptr;
  void (*upload)(void* dst, const void* src, size_t bytes) = nullptr;
  void (*download)(void* dst, const void* src, size_t bytes) = nullptr;
  void (*copy)(void* dst, const void* src, size_t bytes) = nullptr;
  // Waits for the device's outstanding work (timing; errors surface here).
  void (*synchronize)() = nullptr;

  OpLinearForward* linear_forward = nullptr;
  OpRmsnormForward* rmsnorm_forward = nullptr;
  OpSiluMulForward* silu_mul_forward = nullptr;
  OpSigmoidForward* sigmoid_forward = nullptr;
  OpSoftmaxForward* softmax_forward = nullptr;
  OpRopeForward* rope_forward = nullptr;
  OpEmbeddingForward* embedding_forward = nullptr;
  OpLatentAttentionForward* latent_attention_forward = nullptr;
};

const Backend& cpu_backend();
// The CUDA backend, or null when this build has none or the process sees no
// usable GPU (cuda_status() says which).
const Backend* cuda_backend();
std::string cuda_status();
// The backend of `d`; an error naming cuda_status() when it has none.
const Backend& backend_for(Device d);

// The backend the ops run on. Process-wide, set by the program before it runs
// a model (or by a test around its calls); the CPU's by default.
const Backend& active_backend();
void set_active_backend(const Backend& b);

// Errors raised inside a backend's kernels' host code (which need not see
// core/error.h): throws ds::Error with `what`.
[[noreturn]] void backend_error(const std::string& what);

// The CPU's implementations, which the CPU table points to.
namespace cpu {
DS_BACKEND_OPS_DECLARED
}  // namespace cpu

#ifdef DEEPSEEK_HAVE_CUDA
namespace cuda {
// Defined in ops/cuda/: the table, or null with the reason in *why.
const Backend* make_backend(std::string* why);
}  // namespace cuda
#endif

}  // namespace ds::ops
