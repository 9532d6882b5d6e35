#include "core/stage_times.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ds {
namespace {

constexpr const char* kNames[] = {"norms",     "query projection",  "key/value projection",
                                  "attention", "output projection", "routing and gather",
                                  "experts",   "combine",           "dense MLP",
                                  "Engram"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Stage::kCount));

constexpr const char* kPhases[] = {"other calls (training, full forwards)", "prefill steps", "decode steps"};
static_assert(sizeof(kPhases) / sizeof(kPhases[0]) == static_cast<size_t>(Phase::kCount));

constexpr int kStages = static_cast<int>(Stage::kCount);
std::atomic<int64_t> g_ns[static_cast<int>(Phase::kCount)][kStages];
thread_local Phase t_phase = Phase::kOther;

void print_stage_times() {
  for (int p = 0; p < static_cast<int>(Phase::kCount); ++p) {
    double total = 0;
    for (const auto& t : g_ns[p]) total += static_cast<double>(t.load());
    if (total <= 0) continue;
    std::fprintf(stderr, "stage times (DEEPSEEK_STAGE_TIMES), %s:\n", kPhases[p]);
    for (int i = 0; i < kStages; ++i) {
      const double ns = static_cast<double>(g_ns[p][i].load());
      std::fprintf(stderr, "  %-22s %10.1f ms  %5.1f%%\n", kNames[i], ns * 1e-6, 100.0 * ns / total);
    }
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
  g_ns[static_cast<int>(t_phase)][static_cast<int>(s)].fetch_add(static_cast<int64_t>(seconds * 1e9),
                                                                 std::memory_order_relaxed);
}

StagePhase::StagePhase(Phase p) : saved_(t_phase) { t_phase = p; }
StagePhase::~StagePhase() { t_phase = saved_; }

}  // namespace ds
