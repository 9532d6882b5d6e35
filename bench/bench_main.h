// The main() of the Google Benchmark executables: the program's heap
// settings, the run's context (OpenMP threads, the OpenBLAS kernel set) in
// the report header, then every benchmark register_all() registered.
#pragma once

#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <string>

#include "core/simd.h"
#include "core/system.h"

namespace ds::bench {

inline int bench_main(int argc, char** argv, void (*register_all)()) {
  ds::keep_freed_memory_in_heap();  // as the program does
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // Debian's OpenBLAS picks its kernels at run time; on CPUs newer than it
  // knows it falls back to an older (slower) set, which this makes visible
  // wherever cblas_sgemm is a baseline.
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  benchmark::AddCustomContext("openblas_config", openblas_get_config());
  benchmark::AddCustomContext("omp_threads", std::to_string(omp_get_max_threads()));
  // The SIMD target the hand-written kernels dispatch to (DEEPSEEK_MAX_CPU_ISA caps it).
  benchmark::AddCustomContext("simd_target", ds::simd_target_name());
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace ds::bench
