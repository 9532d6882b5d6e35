// Shared helpers for the op tests: random inputs, tolerant comparisons and
// central finite differences in double precision.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/simd.h"

namespace ds::test {

// Restores the OpenMP thread count when a test that changes it ends.
struct ThreadCountGuard {
  int saved = omp_get_max_threads();
  ~ThreadCountGuard() { omp_set_num_threads(saved); }
};

// Expects run() to return bitwise the same value on 1, 2 and 3 threads.
template <typename F>
void expect_same_for_any_thread_count(F run) {
  ThreadCountGuard guard;
  omp_set_num_threads(1);
  const auto want = run();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(run(), want) << threads << " threads";
  }
}

// Runs fn(name) once for every SIMD target this build compiled and this CPU
// runs (within the environment's cap), each time with the kernels
// dispatching to that target, so one run of a test covers every path.
template <typename F>
void for_each_simd_target(F fn) {
  ensure_simd_targets();  // the environment's cap first
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    fn(hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(detail::capped_simd_targets());  // back to the capped set (0: all the CPU has)
}

inline std::vector<float> randn(size_t n, uint64_t seed, float std = 1.0f) {
  std::vector<float> x(n);
  fill_normal(x.data(), static_cast<int64_t>(n), std, seed);
  return x;
}

inline std::vector<double> to_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::fabs(v));
  return m;
}

// Expects |got - want| <= atol + rtol * max|want| elementwise; reports the worst index.
template <typename A, typename B>
void expect_close(const std::vector<A>& got, const std::vector<B>& want, double rtol, double atol,
                  const char* what = "") {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (auto v : want) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  double worst = -1;
  size_t wi = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (!(err <= worst)) {
      worst = err;
      wi = i;
    }
  }
  if (got.empty()) return;
  EXPECT_LE(worst, atol + rtol * scale) << what << ": worst at " << wi << " got " << got[wi] << " want " << want[wi]
                                        << " (scale " << scale << ")";
}

// Central finite differences of a scalar function f(x) in double: returns df/dx.
inline std::vector<double> numeric_grad(const std::function<double(const std::vector<double>&)>& f,
                                        std::vector<double> x, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double fp = f(x);
    x[i] = saved - h;
    double fm = f(x);
    x[i] = saved;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// sum_i w_i * y_i: the scalar a gradient check differentiates, with fixed
// random weights w so every output element matters.
inline double weighted_sum(const std::vector<double>& y, const std::vector<double>& w) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
  return s;
}

// A fresh folder under /tmp (mkdtemp), removed with everything in it at the
// end of the scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "ds_test") {
    std::string tmpl = "/tmp/" + prefix + "_XXXXXX";
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ds::test
