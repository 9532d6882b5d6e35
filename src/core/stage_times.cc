#include "core/stage_times.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ds {
namespace {

constexpr const char* kNames[] = {"norms",     "query projection",  "key/value projection",
                                  "attention", "output projection", "routing and gather",
                                  "experts",   "combine",           "dense MLP"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Stage::kCount));

std::atomic<int64_t> g_ns[static_cast<int>(Stage::kCount)];

void print_stage_times() {
  double total = 0;
  for (const auto& t : g_ns) total += static_cast<double>(t.load());
  if (total <= 0) return;
  std::fprintf(stderr, "stage times (DEEPSEEK_STAGE_TIMES):\n");
  for (int i = 0; i < static_cast<int>(Stage::kCount); ++i) {
    const double ns = static_cast<double>(g_ns[i].load());
    std::fprintf(stderr, "  %-22s %10.1f ms  %5.1f%%\n", kNames[i], ns * 1e-6, 100.0 * ns / total);
  }
}

bool read_enabled() {
  const char* v = std::getenv("DEEPSEEK_STAGE_TIMES");
  const bool on = v && std::strcmp(v, "0") != 0 && *v != '\0';
  if (on) std::atexit(print_stage_times);
  return on;
}

}  // namespace

bool stage_times_enabled() {
  static const bool on = read_enabled();
  return on;
}

void add_stage_time(Stage s, double seconds) {
  g_ns[static_cast<int>(s)].fetch_add(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
}

}  // namespace ds
