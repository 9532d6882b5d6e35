#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"

namespace ds::io {

namespace {

using json = nlohmann::json;

// Headers of real checkpoints are a few hundred KB; anything near this limit
// is a corrupt length field, not a header.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// Element sizes of every dtype name the format defines, including those we
// cannot hold as a Tensor (they are still validated and may be skipped).
size_t safetensors_elem_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

std::string errno_str() { return std::strerror(errno); }

}  // namespace

DType dtype_from_safetensors(const std::string& name, const std::string& tensor) {
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  if (name == "F8_E4M3") return DType::F8E4M3;
  if (name == "F8_E5M2") return DType::F8E5M2;
  if (name == "I32") return DType::I32;
  if (name == "U32") return DType::U32;
  if (name == "I64") return DType::I64;
  DS_FAIL("tensor '{}' has dtype {}, which this engine does not load (supported: F32, BF16, F16, F8_E4M3, F8_E5M2, "
          "I32, U32, I64)",
          tensor, name);
}

std::string safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F8E4M3: return "F8_E4M3";
    case DType::F8E5M2: return "F8_E5M2";
    case DType::I32: return "I32";
    case DType::U32: return "U32";
    case DType::I64: return "I64";
    case DType::F4E2M1:
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q4_1:
    case DType::Q6_K:
      break;  // stored as I8 or U8 bytes, not a dtype of its own
  }
  DS_FAIL("no safetensors name for dtype {}", static_cast<int>(t));
}

std::vector<TensorInfo> SafetensorsFile::parse_header(const char* text, size_t len, uint64_t data_size,
                                                      std::map<std::string, std::string>* metadata) {
  json h;
  try {
    h = json::parse(text, text + len);
  } catch (const json::exception& e) {
    DS_FAIL("safetensors header is not valid JSON: {}", e.what());
  }
  DS_CHECK(h.is_object(), "safetensors header must be a JSON object, got {}", h.type_name());
  std::vector<TensorInfo> infos;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      DS_CHECK(v.is_object(), "safetensors __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        DS_CHECK(m.value().is_string(), "safetensors __metadata__ value for '{}' is not a string", m.key());
        if (metadata) (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    DS_CHECK(!name.empty(), "safetensors header has a tensor with an empty name");
    DS_CHECK(v.is_object(), "tensor '{}': header entry must be an object", name);
    DS_CHECK(v.contains("dtype") && v["dtype"].is_string(), "tensor '{}': missing or non-string dtype", name);
    DS_CHECK(v.contains("shape") && v["shape"].is_array(), "tensor '{}': missing or non-array shape", name);
    DS_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
             "tensor '{}': data_offsets must be [begin, end]", name);
    TensorInfo info;
    info.name = name;
    info.dtype_name = v["dtype"].get<std::string>();
    const size_t es = safetensors_elem_size(info.dtype_name);
    DS_CHECK(es != 0, "tensor '{}': unknown dtype '{}'", name, info.dtype_name);
    // Element count with overflow checks: a hostile shape must not wrap around
    // to a small byte count.
    uint64_t numel = 1;
    for (const json& d : v["shape"]) {
      DS_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
               "tensor '{}': shape entries must be non-negative integers", name);
      const uint64_t dim = d.get<uint64_t>();
      DS_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "tensor '{}': dimension too large",
               name);
      DS_CHECK(dim == 0 || numel <= std::numeric_limits<uint64_t>::max() / dim / es,
               "tensor '{}': shape overflows the addressable size", name);
      numel *= dim;
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const json& o : v["data_offsets"])
      DS_CHECK(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0),
               "tensor '{}': data_offsets must be non-negative integers", name);
    info.begin = v["data_offsets"][0].get<uint64_t>();
    info.end = v["data_offsets"][1].get<uint64_t>();
    DS_CHECK(info.begin <= info.end && info.end <= data_size,
             "tensor '{}': data_offsets [{}, {}] outside the data block of {} bytes (truncated file?)", name,
             info.begin, info.end, data_size);
    DS_CHECK(info.end - info.begin == numel * es,
             "tensor '{}': {} bytes for shape {} of {} ({} bytes expected)", name, info.end - info.begin,
             shape_str(info.shape), info.dtype_name, numel * es);
    infos.push_back(std::move(info));
  }
  // No two tensors may share bytes (empty tensors occupy none).
  std::vector<const TensorInfo*> by_offset;
  for (const auto& i : infos)
    if (i.end > i.begin) by_offset.push_back(&i);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    DS_CHECK(by_offset[i]->begin >= by_offset[i - 1]->end, "tensors '{}' and '{}' overlap in the data block",
             by_offset[i - 1]->name, by_offset[i]->name);
  return infos;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open safetensors file '{}': {}", path, errno_str());
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    DS_FAIL("'{}' is not a regular file", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    DS_FAIL("safetensors file '{}' is {} bytes, too short for a header", path, size);
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file contents reachable
  errno = map_errno;
  DS_CHECK(p != MAP_FAILED, "cannot map '{}': {}", path, errno_str());
  SafetensorsFile f;
  f.path_ = path;
  f.mapping_ = std::shared_ptr<void>(p, [size](void* q) { munmap(q, size); });
  const auto* bytes = static_cast<const unsigned char*>(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian
  DS_CHECK(n <= kMaxHeaderBytes && n <= size - 8,
           "safetensors file '{}': header length {} does not fit the file of {} bytes (truncated or not safetensors)",
           path, n, size);
  try {
    f.infos_ = parse_header(static_cast<const char*>(p) + 8, n, size - 8 - n, &f.metadata_);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", path, e.what()));
  }
  f.data_ = static_cast<const char*>(p) + 8 + n;
  for (size_t i = 0; i < f.infos_.size(); ++i) f.index_[f.infos_[i].name] = i;
  return f;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  DS_CHECK(it != index_.end(), "tensor '{}' not found in '{}'", name, path_);
  return infos_[it->second];
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& i = info(name);
  DType t = dtype_from_safetensors(i.dtype_name, name);
  // The mapping is read-only: tensors from a file must not be written to.
  return Tensor::borrow(const_cast<char*>(data_ + i.begin), i.shape, t, mapping_);
}

SafetensorsSet SafetensorsSet::open_files(const std::vector<std::string>& paths) {
  DS_CHECK(!paths.empty(), "no safetensors files given");
  SafetensorsSet s;
  for (const auto& p : paths) {
    s.files_.push_back(SafetensorsFile::open(p));
    const size_t fi = s.files_.size() - 1;
    for (const auto& i : s.files_.back().tensors()) {
      auto [it, inserted] = s.where_.emplace(i.name, fi);
      DS_CHECK(inserted, "tensor '{}' appears in both '{}' and '{}'", i.name, s.files_[it->second].path(), p);
    }
  }
  return s;
}

SafetensorsSet SafetensorsSet::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  DS_CHECK(fs::is_directory(dir), "model folder '{}' does not exist or is not a folder", dir);
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    json j;
    try {
      std::ifstream in(index);
      j = json::parse(in);
    } catch (const json::exception& e) {
      DS_FAIL("'{}' is not valid JSON: {}", index.string(), e.what());
    }
    DS_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
             "'{}' has no weight_map object", index.string());
    std::vector<std::string> shards;
    std::map<std::string, std::string> expected;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      DS_CHECK(it.value().is_string(), "'{}': weight_map entry for '{}' is not a file name", index.string(), it.key());
      const std::string shard = it.value().get<std::string>();
      DS_CHECK(shard.find('/') == std::string::npos && shard != ".." && !shard.empty(),
               "'{}': shard name '{}' must be a plain file name", index.string(), shard);
      expected[it.key()] = shard;
      if (std::find(shards.begin(), shards.end(), shard) == shards.end()) shards.push_back(shard);
    }
    std::sort(shards.begin(), shards.end());
    std::vector<std::string> paths;
    for (const auto& sh : shards) paths.push_back((fs::path(dir) / sh).string());
    SafetensorsSet s = open_files(paths);
    for (const auto& [name, shard] : expected) {
      DS_CHECK(s.contains(name), "'{}' lists tensor '{}' in '{}', but that shard does not hold it", index.string(),
               name, shard);
      const std::string actual = fs::path(s.files_[s.where_.at(name)].path()).filename().string();
      DS_CHECK(actual == shard, "'{}' lists tensor '{}' in '{}', but it is in '{}'", index.string(), name, shard,
               actual);
    }
    return s;
  }
  const fs::path single = fs::path(dir) / "model.safetensors";
  DS_CHECK(fs::exists(single), "model folder '{}' has neither model.safetensors.index.json nor model.safetensors",
           dir);
  return open_files({single.string()});
}

const TensorInfo& SafetensorsSet::info(const std::string& name) const {
  auto it = where_.find(name);
  DS_CHECK(it != where_.end(), "tensor '{}' not found in the checkpoint", name);
  return files_[it->second].info(name);
}

const uint8_t* SafetensorsFile::bytes(const std::string& name) const {
  return reinterpret_cast<const uint8_t*>(data_ + info(name).begin);
}

const uint8_t* SafetensorsSet::bytes(const std::string& name) const {
  auto it = where_.find(name);
  DS_CHECK(it != where_.end(), "tensor '{}' not found in the checkpoint", name);
  return files_[it->second].bytes(name);
}

Tensor SafetensorsSet::tensor(const std::string& name) const {
  auto it = where_.find(name);
  DS_CHECK(it != where_.end(), "tensor '{}' not found in the checkpoint", name);
  return files_[it->second].tensor(name);
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : where_) n.push_back(k);
  return n;
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    DS_CHECK(!name.empty() && name != "__metadata__", "cannot save a tensor named '{}'", name);
    DS_CHECK(!h.contains(name), "tensor name '{}' given twice", name);
    DS_CHECK(t.defined() && t.device() == Device::CPU, "tensor '{}' must be a defined CPU tensor", name);
    const uint64_t bytes = t.nbytes();
    h[name] = {{"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // keep the data block 8-byte aligned
  AtomicFile f(path);
  unsigned char len[8];
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(len, 8);
  f.write(header);
  for (const auto& [name, t] : tensors) {
    if (t.is_contiguous()) {
      f.write(t.raw(), t.nbytes());
    } else {
      Tensor c = t.contiguous();
      f.write(c.raw(), c.nbytes());
    }
  }
  f.commit();
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<Entry>& entries,
                                     const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& e : entries) {
    DS_CHECK(!e.name.empty() && e.name != "__metadata__", "cannot save a tensor named '{}'", e.name);
    DS_CHECK(!h.contains(e.name), "tensor name '{}' given twice", e.name);
    const size_t es = safetensors_elem_size(e.dtype_name);
    DS_CHECK(es > 0, "tensor '{}': '{}' is not a safetensors dtype", e.name, e.dtype_name);
    DS_CHECK(static_cast<uint64_t>(shape_numel(e.shape)) * es == e.bytes,
             "tensor '{}': {} bytes do not hold {} {} values", e.name, e.bytes, shape_str(e.shape), e.dtype_name);
    h[e.name] = {{"dtype", e.dtype_name}, {"shape", e.shape}, {"data_offsets", {off, off + e.bytes}}};
    off += e.bytes;
    ends_.push_back(off);
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // keep the data block 8-byte aligned
  file_ = std::make_unique<AtomicFile>(path);
  unsigned char len[8];
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  file_->write(len, 8);
  file_->write(header);
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const void* data, size_t n) {
  DS_CHECK(file_, "safetensors writer: already committed");
  DS_CHECK(!ends_.empty() && written_ + n <= ends_.back(), "safetensors writer: {} bytes past the last tensor's end",
           written_ + n - (ends_.empty() ? 0 : ends_.back()));
  file_->write(data, n);
  written_ += n;
}

void SafetensorsWriter::commit() {
  DS_CHECK(file_, "safetensors writer: already committed");
  const uint64_t want = ends_.empty() ? 0 : ends_.back();
  DS_CHECK(written_ == want, "safetensors writer: {} of {} bytes written", written_, want);
  file_->commit();
  file_.reset();
}

}  // namespace ds::io
