// Helpers of the training-loop tests (train_test, v4_trainer_test): json
// datasets with a known split into micro-batches, and a run's metrics.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ds::test {

// A dataset_type=json file dir/data<rows>.json: `steps` batches of `rows`
// rows of seq + 1 ids below vocab, from a fixed LCG seeded by salt.
inline std::filesystem::path json_dataset(const std::filesystem::path& dir, int64_t steps, int64_t rows, int64_t seq,
                                          int64_t vocab, int salt) {
  nlohmann::json all = nlohmann::json::array();
  uint64_t x = 12345 + static_cast<uint64_t>(salt);
  for (int64_t s = 0; s < steps; ++s) {
    nlohmann::json step = nlohmann::json::array();
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int> ids;
      for (int64_t j = 0; j <= seq; ++j) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        ids.push_back(static_cast<int>((x >> 33) % static_cast<uint64_t>(vocab)));
      }
      step.push_back(ids);
    }
    all.push_back(step);
  }
  const auto f = dir / ("data" + std::to_string(rows) + ".json");
  std::ofstream(f) << all.dump();
  return f;
}

// The same rows as two micro-batches per batch (each batch's first half,
// then its second), in dir/halves.json.
inline std::filesystem::path json_halves(const std::filesystem::path& file) {
  const auto all = nlohmann::json::parse(std::ifstream(file));
  nlohmann::json halves = nlohmann::json::array();
  for (const auto& step : all) {
    const size_t half = step.size() / 2;
    nlohmann::json a = nlohmann::json::array(), b = nlohmann::json::array();
    for (size_t r = 0; r < step.size(); ++r) (r < half ? a : b).push_back(step[r]);
    halves.push_back(a);
    halves.push_back(b);
  }
  const auto f = file.parent_path() / "halves.json";
  std::ofstream(f) << halves.dump();
  return f;
}

// The lines of RUN/metrics.jsonl.
inline std::vector<nlohmann::json> run_metrics(const std::filesystem::path& run) {
  std::vector<nlohmann::json> v;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) v.push_back(nlohmann::json::parse(line));
  return v;
}

}  // namespace ds::test
