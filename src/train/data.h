// Training data: where the batches of `deepseek train` come from.
//
// Every dataset yields model::TrainBatch values of `batch` rows of `seq`
// tokens and can report and restore its position (a JSON value stored in
// checkpoints), so a resumed run sees exactly the batches the uninterrupted
// one would have seen.
//
// dataset_type (MaxText's key):
//   synthetic  MaxText's: no files; one fixed batch of random tokens (from
//              the seed) every step, positions 0..seq-1, one segment per row.
//              With synthetic_task=copy instead a learnable task with a known
//              answer: each row is n random tokens followed by the same n
//              tokens again, fresh every step (drawn from seed and step), so
//              the second half can be predicted exactly.
//   json       dataset_path=FILE.json: a JSON array of steps, each an array of
//              `batch` rows of seq + 1 token ids; consumed in order, no
//              shuffling; inputs ids[:-1], targets ids[1:], one document per
//              row. A recorded run's exact batches replay here.
//   tokens     dataset_path=DIR written by `deepseek prepare`: uint32 token
//              shards of whole documents. Documents are packed into rows with
//              segment ids 1, 2, ... and positions that restart at 0 per
//              document; a target never crosses into the next document;
//              the document order is shuffled per epoch from the seed.
//
// Details of the synthetic tasks: random counts every target; copy counts
// every target too, so its loss cannot fall below (n - 1) / (2n - 1) ln V
// for rows of 2n = seq + 1 tokens (the first half is unpredictable). For odd
// seq + 1 the row's last token is padding (id 0, an uncounted target).
//
// Details of tokens: rows hold seq + 1 tokens; inputs are row[:-1], targets
// row[1:]. Documents (in order of a permutation drawn from seed + epoch for
// Train; in stored order for Eval) fill rows greedily; one longer than the
// room left is cut and its rest starts the next row as the same document.
// Positions count from 0 within each piece of a document in a row, so a
// continued document restarts at 0 in the next row and positions stay
// below seq + 1. A target counts (target_segment_ids = its segment id) only
// when it belongs to the same document piece as its input. Train epochs run
// on forever; Eval wraps around to its first document, and rewind() goes
// back there. With packing=false a row holds one piece of one document and
// the rest is padding: id 0, segment 0, never a counted target.
//
// state(): synthetic and json {"step": n} (the next step's index); tokens
// {"epoch": e, "index": i, "offset": o, "documents": D} (place i in epoch
// e's order, o tokens of that document already used; D guards against
// restoring into another corpus).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"

namespace ds::train {

struct DataConfig {
  std::string dataset_type = "synthetic";  // synthetic | json | tokens
  std::string synthetic_task = "random";   // random | copy (synthetic only)
  std::string dataset_path;                // json: a file; tokens: a directory
  int64_t batch = 1;                       // rows per step (per_device_batch_size)
  int64_t seq = 0;                         // tokens per row (max_target_length)
  int64_t vocab_size = 0;                  // ids must be below it
  uint64_t seed = 0;                       // data_shuffle_seed
  bool packing = true;                     // tokens: several documents per row (MaxText's packing)
};

enum class Split { Train, Eval };

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The next batch; ds::Error when a finite dataset (json) has run out.
  virtual model::TrainBatch next() = 0;
  // The position, enough to continue with exactly the batches that follow.
  virtual nlohmann::json state() const = 0;
  virtual void restore(const nlohmann::json& state) = 0;
  // Back to the first batch (eval runs over the same batches each time).
  virtual void rewind() = 0;
  // Batches in one pass over the data (an eval runs one pass), or -1 when
  // the dataset has no end (synthetic).
  virtual int64_t batches_per_pass() const { return -1; }
};

// Opens the dataset; ds::Error (one line) for a missing or empty path, a
// malformed file, an id outside the vocabulary, or a split the type lacks
// (only `tokens` has an eval split).
std::unique_ptr<Dataset> open_dataset(const DataConfig& cfg, Split split = Split::Train);

}  // namespace ds::train
