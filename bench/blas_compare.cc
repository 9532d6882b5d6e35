// Raw GEMM throughput of the BLAS libraries Debian ships, one library per
// binary (they export the same cblas symbols). Built and run by
// bench/blas_compare.sh; the numbers behind the choice of GEMM in
// docs/performance.md.
//
// Shapes: large square, a transformer projection, expert-sized (64x256x128),
// 16 expert-sized products spread over the threads (each single-threaded, as a
// grouped matmul runs them), and decode GEMV.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(USE_DNNL)
#include <dnnl.h>
#elif defined(USE_XSMM)
#include <libxsmm.h>
#else
#include <cblas.h>
#endif

#if defined(USE_OPENBLAS)
extern "C" char* openblas_get_corename(void);
#endif

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Row-major C[M,N] = A[M,K] B[K,N] with the library under test.
static void sgemm(int M, int N, int K, const float* A, const float* B, float* C) {
#if defined(USE_DNNL)
  dnnl_sgemm('N', 'N', M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
#elif defined(USE_XSMM)
  // LIBXSMM is column-major: C^T[N,M] = B^T[N,K] A^T[K,M]. Its JIT kernel
  // (dispatched once per shape) is what makes it fast on small products;
  // larger shapes go to libxsmm_sgemm, which hands them to the fallback BLAS.
  struct Entry { int M, N, K; libxsmm_smmfunction f; };
  static thread_local std::vector<Entry> cache;
  libxsmm_smmfunction f = nullptr;
  for (auto& e : cache)
    if (e.M == M && e.N == N && e.K == K) f = e.f;
  if (!f && static_cast<long>(M) * N * K <= (1L << 22)) {  // small: single-threaded JIT kernel
    const float alpha = 1.0f, beta = 0.0f;
    f = libxsmm_smmdispatch(N, M, K, &N, &K, &N, &alpha, &beta, nullptr, nullptr);
    cache.push_back({M, N, K, f});
  }
  if (f) f(B, A, C);
  else libxsmm_sgemm(nullptr, nullptr, &N, &M, &K, nullptr, B, &N, A, &K, nullptr, C, &N);
#else
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
#endif
}

template <typename F>
static double best_rate(double flops, F&& f) {
  f();  // warm-up (JIT, thread start)
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    int iters = 0;
    double t0 = now(), t;
    do {
      f();
      ++iters;
      t = now() - t0;
    } while (t < 0.2);
    best = std::max(best, flops * iters / t / 1e9);
  }
  return best;
}

int main() {
#if defined(USE_DNNL)
  const char* lib = "oneDNN sgemm";
#elif defined(USE_XSMM)
  const char* lib = "LIBXSMM";
#elif defined(USE_BLIS)
  const char* lib = "BLIS";
#else
  const char* lib = "OpenBLAS";
#endif
  std::printf("library: %s, threads %d", lib, omp_get_max_threads());
#if defined(USE_OPENBLAS)
  std::printf(" (OpenBLAS core: %s)", openblas_get_corename());
#endif
  std::printf("\n");
  const int shapes[][3] = {{1024, 1024, 1024}, {512, 1408, 2048}, {64, 256, 128}, {1, 4096, 4096}};
  for (auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    std::vector<float> A(size_t(M) * K, 0.5f), B(size_t(K) * N, 0.25f), C(size_t(M) * N);
    double r = best_rate(2.0 * M * N * K, [&] { sgemm(M, N, K, A.data(), B.data(), C.data()); });
    std::printf("  %5dx%5dx%5d  %7.1f GFLOP/s\n", M, N, K, r);
  }
  // 16 experts of 64x256x128, one single-threaded product per expert.
  {
    const int E = 16, M = 64, N = 256, K = 128;
    std::vector<float> A(size_t(E) * M * K, 0.5f), B(size_t(E) * K * N, 0.25f), C(size_t(E) * M * N);
    double r = best_rate(2.0 * E * M * N * K, [&] {
#pragma omp parallel for schedule(static)
      for (int e = 0; e < E; ++e) sgemm(M, N, K, &A[size_t(e) * M * K], &B[size_t(e) * K * N], &C[size_t(e) * M * N]);
    });
    std::printf("  16 experts 64x256x128 over threads  %7.1f GFLOP/s\n", r);
  }
  return 0;
}
