// Small parts of the training loop (train/trainer.cc): batch rows and
// weights, progress text, the metrics a resumed run keeps, and a string
// broadcast.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/model.h"

namespace ds::train {

// The targets a batch counts (target segment id not 0).
double counted_targets(const model::TrainBatch& b);
// "m:ss" or "h:mm:ss" ("?" when unknown), and a rate as "950" or "12.3k".
std::string fmt_duration(double seconds);
std::string fmt_rate(double x);
// The metrics of steps before `step` from an earlier run's metrics.jsonl
// (a resumed run rewrites the file without the steps it repeats); lines cut
// short by a crash are dropped.
std::vector<nlohmann::json> read_metrics_before(const std::filesystem::path& file, int64_t step);
// Rows [first, first + rows) of a batch.
model::TrainBatch slice_rows(const model::TrainBatch& b, int64_t first, int64_t rows);
// A string from rank `root` to every rank of `c` (collective).
std::string broadcast_string(dist::Communicator& c, std::string s, int root = 0);

}  // namespace ds::train
