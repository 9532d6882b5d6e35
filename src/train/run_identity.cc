#include "train/run_identity.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "train/loop_util.h"

namespace ds::train {

namespace fs = std::filesystem;

namespace {

// The data's files and their sizes (a folder's plain files, or the file).
nlohmann::json data_files(const std::string& path) {
  nlohmann::json files = nlohmann::json::object();
  if (path.empty()) return files;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    files[fs::path(path).filename().string()] = static_cast<int64_t>(fs::file_size(path, ec));
  } else if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.is_regular_file(ec)) files[e.path().filename().string()] = static_cast<int64_t>(e.file_size(ec));
  }
  return files;
}

std::string shown(const nlohmann::json& j) {
  std::string s = j.is_null() ? "(not set)" : j.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

}  // namespace

nlohmann::json run_identity(const TrainConfig& tc, const model::Family& family) {
  return {{"run", tc.as_json},
          {"model", family.hf_config()},
          {"data", {{"dataset_type", tc.data.dataset_type}, {"files", data_files(tc.data.dataset_path)}}}};
}

std::string first_difference(const nlohmann::json& lead, const nlohmann::json& mine, const std::string& who,
                             const std::string& path) {
  if (lead == mine) return "";
  if (lead.is_object() && mine.is_object()) {
    std::map<std::string, int> keys;  // sorted: the first difference is the same on every rank
    for (const auto& [k, v] : lead.items()) keys[k] = 0;
    for (const auto& [k, v] : mine.items()) keys[k] = 0;
    for (const auto& [k, unused] : keys) {
      const nlohmann::json a = lead.contains(k) ? lead[k] : nlohmann::json();
      const nlohmann::json b = mine.contains(k) ? mine[k] : nlohmann::json();
      const std::string d = first_difference(a, b, who, path.empty() ? k : path + "/" + k);
      if (!d.empty()) return d;
    }
  }
  return fmt::format("'{}': rank 0 has {}, {} has {}", path, shown(lead), who, shown(mine));
}

void check_same_run(dist::Communicator& world, const nlohmann::json& identity) {
  if (world.size() < 2) return;
  const std::string text = identity.dump();
  nlohmann::json lead;
  try {
    lead = nlohmann::json::parse(broadcast_string(world, text, 0));
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("internal error: rank 0's run configuration did not arrive whole: {}", e.what());
  }
  const std::string diff = first_difference(lead, identity, fmt::format("rank {}", world.rank()));
  // The highest rank that differs tells every rank what differs.
  int64_t bad = diff.empty() ? -1 : world.rank();
  world.all_reduce(&bad, 1, dist::ReduceOp::Max).wait();
  if (bad < 0) return;
  const std::string what = broadcast_string(world, diff, static_cast<int>(bad));
  DS_FAIL(
      "rank {} was started with another run configuration than rank 0 (every rank must run the same keys, model "
      "and data): {}",
      bad, what);
}

}  // namespace ds::train
