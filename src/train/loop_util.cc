#include "train/loop_util.h"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <fstream>
#include <utility>

namespace ds::train {

double counted_targets(const model::TrainBatch& b) {
  double n = 0;
  for (int32_t s : b.target_segment_ids) n += s != 0;
  return n;
}

std::string fmt_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string fmt_rate(double x) { return x >= 1e4 ? fmt::format("{:.1f}k", x / 1e3) : fmt::format("{:.0f}", x); }

std::vector<nlohmann::json> read_metrics_before(const std::filesystem::path& file, int64_t step) {
  std::vector<nlohmann::json> kept;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      auto j = nlohmann::json::parse(line);
      if (j.contains("step") && j["step"].get<int64_t>() < step) kept.push_back(std::move(j));
    } catch (const nlohmann::json::exception&) {
      // A line cut short by a crash: dropped.
    }
  }
  return kept;
}

model::TrainBatch slice_rows(const model::TrainBatch& b, int64_t first, int64_t rows) {
  model::TrainBatch out;
  out.batch = rows;
  out.seq = b.seq;
  const auto a = static_cast<std::ptrdiff_t>(first * b.seq), e = static_cast<std::ptrdiff_t>((first + rows) * b.seq);
  for (auto [dst, src] : {std::pair{&out.inputs, &b.inputs},
                          {&out.targets, &b.targets},
                          {&out.positions, &b.positions},
                          {&out.segment_ids, &b.segment_ids},
                          {&out.target_segment_ids, &b.target_segment_ids}})
    dst->assign(src->begin() + a, src->begin() + e);
  return out;
}

std::string broadcast_string(dist::Communicator& c, std::string s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  c.broadcast(&n, 1, root).wait();
  s.resize(static_cast<size_t>(n));
  c.broadcast(s.data(), n, root).wait();
  return s;
}

}  // namespace ds::train
