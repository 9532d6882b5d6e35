#include "model/staged.h"

#include <chrono>

namespace ds::model {

namespace {

using clock = std::chrono::steady_clock;
bool g_recording = false;
clock::time_point g_origin;
std::vector<TimelineSpan> g_spans;

double now_s() { return std::chrono::duration<double>(clock::now() - g_origin).count(); }

}  // namespace

void timeline_record(bool on) {
  g_recording = on;
  if (on) {
    g_spans.clear();
    g_origin = clock::now();
  }
}

std::vector<TimelineSpan> timeline_spans() { return g_spans; }

void run_interleaved(std::vector<Staged>& tasks, int64_t layer, bool backward) {
  const size_t n = tasks.size();
  std::vector<Staged::Chain> chains(n);
  std::vector<bool> done(n, false);
  std::vector<double> paused(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    tasks[i].get().promise().chain = &chains[i];
    chains[i].leaf = tasks[i].get();
  }
  for (size_t left = n; left > 0;) {
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      Staged::Chain& c = chains[i];
      if (c.finish) {
        auto f = std::move(c.finish);
        c.finish = nullptr;
        f();
        if (g_recording) g_spans.push_back({layer, backward, static_cast<int>(i), false, paused[i], now_s()});
      }
      const double t0 = g_recording ? now_s() : 0.0;
      c.leaf.resume();
      if (g_recording) {
        paused[i] = now_s();
        g_spans.push_back({layer, backward, static_cast<int>(i), true, t0, paused[i]});
      }
      if (tasks[i].get().done()) {
        done[i] = true;
        --left;
        if (auto e = tasks[i].get().promise().error) std::rethrow_exception(e);
      }
    }
  }
}

void run_staged(Staged task) {
  std::vector<Staged> one;
  one.push_back(std::move(task));
  run_interleaved(one);
}

}  // namespace ds::model
