// GGUF, the single-file model format of llama.cpp and ggml (version 3):
//
//   "GGUF" u32 version, u64 tensor count, u64 key-value count,
//   key-values: string key, u32 value type, value,
//   tensor infos: string name, u32 dims, u64 ne[dims] (fastest first),
//                 u32 tensor type, u64 offset into the data section,
//   padding to `general.alignment` (32 unless the file says), then the data,
//   each tensor at its offset, every offset a multiple of the alignment.
//
// Strings are u64 length + bytes; arrays u32 element type + u64 count +
// elements. Everything little-endian.
//
// Writer streams a file (tensor data from callbacks, so a model need not
// be in memory twice) through io::AtomicFile. Reader maps a file and checks
// it whole before anything is used: the counts against the file's size, every
// string and array inside it, every tensor's bytes inside the data section
// and not overlapping another, dims and element counts that fit; anything
// else is one ds::Error naming the file and what is wrong.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace ds::io::gguf {

enum class ValueType : uint32_t {
  UInt8 = 0,
  Int8 = 1,
  UInt16 = 2,
  Int16 = 3,
  UInt32 = 4,
  Int32 = 5,
  Float32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  UInt64 = 10,
  Int64 = 11,
  Float64 = 12,
};

// ggml's tensor types this engine knows by name (others keep their number).
enum class TensorType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  BF16 = 30,
};

// "F32", "Q4_K", ... or "type N".
std::string type_name(TensorType t);
// Elements per block and bytes per block of a type this engine knows;
// {0, 0} for the others.
struct BlockSize {
  int64_t elements, bytes;
};
BlockSize block_size(TensorType t);

// A key's value: a scalar, a string, or an array of one of them.
struct Value {
  ValueType type = ValueType::UInt32;
  ValueType array_type = ValueType::UInt32;  // type == Array: the elements'
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
  std::vector<std::variant<uint64_t, int64_t, double, bool, std::string>> array;

  static Value u32(uint32_t v);
  static Value i32(int32_t v);
  static Value f32(float v);
  static Value boolean(bool v);
  static Value str(std::string v);
  static Value strings(std::vector<std::string> v);
  static Value i32s(const std::vector<int32_t>& v);
  static Value f32s(const std::vector<float>& v);
};

class Writer {
 public:
  void set(const std::string& key, Value v);
  // ne fastest first; `write` must emit exactly the tensor's bytes.
  void add_tensor(const std::string& name, TensorType type, std::vector<int64_t> ne,
                  std::function<void(std::function<void(const void*, size_t)>)> write);
  // Writes the file atomically; returns its size in bytes.
  uint64_t write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    TensorType type;
    std::vector<int64_t> ne;
    uint64_t bytes;
    std::function<void(std::function<void(const void*, size_t)>)> write;
  };
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
};

struct TensorInfo {
  std::string name;
  TensorType type;
  std::vector<int64_t> ne;  // fastest first
  uint64_t offset = 0;      // into the data section
  uint64_t bytes = 0;       // 0 for a type this engine does not know
  int64_t numel() const;
};

class Reader {
 public:
  static Reader open(const std::string& path);
  // The same over bytes in memory (tests, fuzzing); `origin` names them.
  static Reader parse(std::span<const uint8_t> bytes, const std::string& origin);

  uint32_t version() const { return version_; }
  const std::map<std::string, Value>& values() const { return kv_; }
  const Value* find(const std::string& key) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* tensor(const std::string& name) const;
  // A tensor's bytes (ds::Error for a type this engine does not know).
  std::span<const uint8_t> data(const TensorInfo& t) const;
  uint64_t alignment() const { return alignment_; }

 private:
  struct Mapping;
  std::shared_ptr<Mapping> map_;
  std::span<const uint8_t> bytes_;
  std::string origin_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32, data_start_ = 0;
  std::map<std::string, Value> kv_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
};

}  // namespace ds::io::gguf
