// safetensors: reading (zero-copy mmap, single file or sharded through
// model.safetensors.index.json) and atomic writing.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data block; offsets are relative to the start of the data block.
// Every structural property is checked when the file is opened (header bounds,
// JSON, dtype names, shapes, offsets inside the data block, byte counts equal to
// shape x element size, no two tensors overlapping), so a malformed file gives
// one clear ds::Error and never a crash.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace ds::io {

struct TensorInfo {
  std::string name;
  std::string dtype_name;  // as written in the file ("BF16", "F8_E4M3", ...)
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets within the data block
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates its header.
  static SafetensorsFile open(const std::string& path);
  // Validates a header held in memory (used by open() and the fuzz target);
  // `data_size` is the size of the data block that follows it.
  static std::vector<TensorInfo> parse_header(const char* json, size_t len, uint64_t data_size,
                                              std::map<std::string, std::string>* metadata);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return infos_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  // A tensor borrowing the mapped bytes (no copy); the mapping lives as long as
  // any tensor taken from it.
  Tensor tensor(const std::string& name) const;
  // The tensor's raw bytes (info(name) gives dtype and shape), for dtypes a
  // Tensor cannot hold (packed fp4 as I8/U8, F8_E8M0 scales); valid while
  // this file is open.
  const uint8_t* bytes(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;
  const char* data_ = nullptr;  // start of the data block
  std::vector<TensorInfo> infos_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model folder's weights: model.safetensors.index.json (sharded)
// or a single model.safetensors, or an explicit list of files.
class SafetensorsSet {
 public:
  static SafetensorsSet open_dir(const std::string& dir);
  static SafetensorsSet open_files(const std::vector<std::string>& paths);

  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  Tensor tensor(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  const uint8_t* bytes(const std::string& name) const;  // see SafetensorsFile::bytes
  std::vector<std::string> names() const;  // sorted

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
};

// Maps a safetensors dtype name to ours; throws for names we cannot hold.
DType dtype_from_safetensors(const std::string& name, const std::string& tensor);
std::string safetensors_dtype_name(DType t);

// Writes tensors (any strides; written densely in logical order) to `path`
// atomically: a temporary file in the same folder, flushed to disk, then
// renamed over `path`. Names must be unique and non-empty.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes a safetensors file one tensor at a time, for tensors made one by
// one (a quantized model: each tensor is widened, quantized and written
// before the next is read) and for dtypes a Tensor cannot hold (raw bytes
// under any safetensors dtype name, e.g. U8 blocks). The header lists every
// tensor up front; write() then takes the bytes in that order. Atomic as
// save_safetensors: nothing replaces `path` unless commit() runs after
// every byte was written.
class AtomicFile;
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name, dtype_name;  // dtype_name as the file says it ("BF16", "U8", ...)
    Shape shape;
    uint64_t bytes = 0;  // checked against the shape and the dtype's element size
  };
  SafetensorsWriter(const std::string& path, const std::vector<Entry>& entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();  // without commit(): the file is not written
  // The next bytes of the current tensor (a tensor may come in pieces).
  void write(const void* data, size_t n);
  void commit();

 private:
  std::unique_ptr<AtomicFile> file_;
  std::vector<uint64_t> ends_;  // each tensor's end offset, in order
  uint64_t written_ = 0;
};

}  // namespace ds::io
