// Wall-clock time per stage of the model's layers, for finding where a
// prefill or a step spends its time. Off unless the environment sets
// DEEPSEEK_STAGE_TIMES=1; then each stage's total (every layer, every call,
// on the calling thread) and its share are printed to stderr at exit, one
// table per phase that took time: generation's prefill steps, its decode
// steps (one new token for every sequence, each continuing a cache), and
// the rest (training steps, full forwards). Off, a stage costs one load and
// a branch.
#pragma once

#include <chrono>

namespace ds {

enum class Stage {
  kNorm,
  kQueryProj,
  kKvProj,
  kAttention,
  kOutProj,
  kRouting,
  kExperts,
  kCombine,
  kDenseMlp,
  kEngram,
  kCount
};

enum class Phase { kOther, kPrefill, kDecode, kCount };

bool stage_times_enabled();
void add_stage_time(Stage s, double seconds);

// The phase the calling thread's stages count toward while it lives (then
// the one before).
class StagePhase {
 public:
  explicit StagePhase(Phase p);
  ~StagePhase();
  StagePhase(const StagePhase&) = delete;
  StagePhase& operator=(const StagePhase&) = delete;

 private:
  Phase saved_;
};

// Adds the time from construction to destruction to stage s, when enabled.
class StageTimer {
 public:
  explicit StageTimer(Stage s) : s_(s), on_(stage_times_enabled()) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~StageTimer() { stop(); }
  // Ends the stage before the end of the scope (once).
  void stop() {
    if (on_) add_stage_time(s_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    on_ = false;
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  Stage s_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace ds
