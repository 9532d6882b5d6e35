// The training loop of `deepseek train`: MaxText's train step on one process.
//
// Per step s (0-based; the update it applies is the (s+1)-th):
//   lr = schedule(s)
//   gradient_accumulation_steps micro-batches; each adds w_i x its gradient,
//     w_i = (its counted targets) / (all counted targets of the step), so the
//     step's gradient is that of the token-weighted mean loss (MaxText sums
//     the micro-batches' gradients and divides by the total weight);
//   raw_grad_norm over every gradient; a non-finite loss or norm skips the
//     step (no update, logged) and max_consecutive_skipped_steps in a row stop
//     the run with an error;
//   clip to gradient_clipping_threshold (0: off), AdamW, then the aux-loss-free
//     bias update: bias += sum over micro-batches of rate * sign(mean load - load)
//     per MoE layer (main and MTP);
//   metrics.jsonl gets one line; eval every eval_interval steps (and at the
//     end); a checkpoint after every checkpoint_period updates and at the end.
// resume=true continues from the newest complete checkpoint; since every
// step is deterministic (thread-count-independent kernels, data position
// and optimizer state saved), the continued losses equal an uninterrupted
// run's bit for bit. SIGINT/SIGTERM finish the current step, save a
// checkpoint and stop.
#pragma once

#include <cstdint>
#include <string>

#include "model/staged.h"
#include "train/config.h"

namespace ds::train {

struct TrainSummary {
  std::string run_dir;
  int64_t start_step = 0, end_step = 0;  // updates applied before and after this run
  double first_loss = 0, last_loss = 0;
  double last_eval_loss = -1;  // -1: no eval ran
  int64_t skipped_steps = 0;
  bool interrupted = false;
};

TrainSummary train(const RunConfig& rc);

// The loss curve as an SVG picture, written atomically to `path`: the
// training lm_loss per step (without the MTP, balance and indexer terms, so
// that it compares with the eval points, which leave them out too) and the
// eval loss points.
void write_loss_svg(const std::string& path, const std::vector<std::pair<int64_t, double>>& train_loss,
                    const std::vector<std::pair<int64_t, double>>& eval_loss, const std::string& title);

// The batch-split schedule of one layer as an SVG timeline: for the forward
// and the backward, one row per micro-batch with its compute spans and,
// under them, its communication in flight.
void write_timeline_svg(const std::string& path, const std::vector<model::TimelineSpan>& spans, int64_t layer,
                        const std::string& title);

}  // namespace ds::train
