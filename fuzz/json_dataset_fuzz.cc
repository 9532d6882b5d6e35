// libFuzzer target for the JSON training dataset (dataset_type=json: a JSON
// array of steps, each an array of `batch` rows of seq + 1 token ids), read
// through ds::train::open_dataset as `deepseek train` does, and for the data
// state a checkpoint restores into it. The input is 3 bytes that choose the
// batch (1..4), seq (1..16) and vocab_size (1..1021, or 2^31), then the
// dataset file (written to an in-memory file, fuzz/memfile.h), then
// optionally a NUL byte and the JSON of a saved state. Opening must either
// succeed or raise ds::Error; an opened dataset must replay exactly the ids of
// the file, step by step, with ids below vocab_size, positions 0..seq-1 and
// one segment per row, then raise ds::Error once exhausted; restore() must
// either take the state or raise ds::Error. A crash, a sanitizer report,
// another exception type or a batch that differs from the file is a finding.
// Built by fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON with clang) or
// scripts/fuzz.sh:
//   build-fuzz/fuzz/json_dataset_fuzz -max_len=4096 -dict=fuzz/json.dict fuzz/corpus/json_dataset
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"
#include "json_mutator.h"
#include "memfile.h"
#include "train/data.h"

namespace {

using json = nlohmann::json;

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "json_dataset_fuzz: an opened dataset breaks: %s\n", what);
  std::abort();
}

// Steps `from`.. of `d` against the file's ids `j`, then next() must say the
// dataset is exhausted.
void replay(ds::train::Dataset& d, const json& j, const ds::train::DataConfig& cfg, uint64_t from) {
  const int64_t B = cfg.batch, T = cfg.seq;
  for (uint64_t s = from; s < j.size(); ++s) {
    ds::model::TrainBatch b;
    try {
      b = d.next();
    } catch (const ds::Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      broken("next() refused a step the file holds");
    }
    const size_t n = static_cast<size_t>(B * T);
    if (b.batch != B || b.seq != T || b.inputs.size() != n || b.targets.size() != n || b.positions.size() != n ||
        b.segment_ids.size() != n || b.target_segment_ids.size() != n)
      broken("batch shape");
    for (int64_t r = 0; r < B; ++r)
      for (int64_t c = 0; c < T; ++c) {
        const size_t o = static_cast<size_t>(r * T + c);
        const json& row = j[s][static_cast<size_t>(r)];
        if (b.inputs[o] != row[static_cast<size_t>(c)].get<int64_t>() ||
            b.targets[o] != row[static_cast<size_t>(c + 1)].get<int64_t>())
          broken("an id differs from the file");
        if (b.inputs[o] < 0 || b.inputs[o] >= cfg.vocab_size || b.targets[o] < 0 || b.targets[o] >= cfg.vocab_size)
          broken("an id outside the vocabulary");
        if (b.positions[o] != c || b.segment_ids[o] != 1 || b.target_segment_ids[o] != 1)
          broken("positions or segments");
      }
  }
  if (d.state() != json{{"step", j.size()}}) broken("state() after the last step");
  try {
    (void)d.next();
    broken("next() past the end did not throw");
  } catch (const ds::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  ds::train::DataConfig cfg;
  cfg.dataset_type = "json";
  cfg.batch = 1 + data[0] % 4;
  cfg.seq = 1 + data[1] % 16;
  cfg.vocab_size = data[2] == 255 ? int64_t{1} << 31 : 1 + 4 * int64_t{data[2]};
  const std::string_view rest(reinterpret_cast<const char*>(data) + 3, size - 3);
  const size_t nul = rest.find('\0');
  const std::string_view file_text = rest.substr(0, nul);
  static ds_fuzz::MemFile file;
  cfg.dataset_path = file.write(reinterpret_cast<const uint8_t*>(file_text.data()), file_text.size());

  std::unique_ptr<ds::train::Dataset> d;
  try {
    d = ds::train::open_dataset(cfg);
  } catch (const ds::Error&) {
    return 0;
  }
  // Accepted: the file is JSON of the promised shape.
  const json j = json::parse(file_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array() || j.empty()) broken("accepted something that is not a non-empty JSON array");
  for (const auto& step : j) {
    if (!step.is_array() || static_cast<int64_t>(step.size()) != cfg.batch) broken("a step of the wrong size");
    for (const auto& row : step) {
      if (!row.is_array() || static_cast<int64_t>(row.size()) != cfg.seq + 1) broken("a row of the wrong size");
      for (const auto& v : row)
        if (!v.is_number_integer()) broken("an id that is not an integer");
    }
  }
  if (d->state() != json{{"step", 0}}) broken("state() of a fresh dataset");
  replay(*d, j, cfg, 0);
  d->rewind();
  if (d->state() != json{{"step", 0}}) broken("state() after rewind()");

  // A saved state, as a checkpoint would restore it.
  if (nul != std::string_view::npos) {
    const json state = json::parse(rest.substr(nul + 1), nullptr, /*allow_exceptions=*/false);
    if (state.is_discarded()) return 0;  // the checkpoint reader refuses what is not JSON
    try {
      d->restore(state);
    } catch (const ds::Error&) {
      if (d->state() != json{{"step", 0}}) broken("a refused restore() moved the dataset");
      return 0;
    }
    const json at = d->state();
    if (!at.contains("step") || !at["step"].is_number_unsigned() || at["step"].get<uint64_t>() > j.size())
      broken("restore() took a step past the end");
    replay(*d, j, cfg, at["step"].get<uint64_t>());
  }
  return 0;
}

// JSON-aware node mutations of the dataset and the state after the 3 shape
// bytes (fuzz/json_mutator.h), or libFuzzer's own on the whole input.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/3, /*split_nul=*/true);
}
