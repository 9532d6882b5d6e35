#include "io/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "io/atomic_file.h"

namespace ds::io::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kVersion = 3;
constexpr uint64_t kAlignment = 32;
// Bounds a hostile header cannot make us allocate past.
constexpr uint64_t kMaxStringBytes = uint64_t{1} << 30;
constexpr uint64_t kMaxDims = 4;

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::string type_name(TensorType t) {
  switch (t) {
    case TensorType::F32:
      return "F32";
    case TensorType::F16:
      return "F16";
    case TensorType::BF16:
      return "BF16";
    case TensorType::Q4_0:
      return "Q4_0";
    case TensorType::Q4_1:
      return "Q4_1";
    case TensorType::Q5_0:
      return "Q5_0";
    case TensorType::Q5_1:
      return "Q5_1";
    case TensorType::Q8_0:
      return "Q8_0";
    case TensorType::Q8_1:
      return "Q8_1";
    case TensorType::Q2_K:
      return "Q2_K";
    case TensorType::Q3_K:
      return "Q3_K";
    case TensorType::Q4_K:
      return "Q4_K";
    case TensorType::Q5_K:
      return "Q5_K";
    case TensorType::Q6_K:
      return "Q6_K";
    case TensorType::Q8_K:
      return "Q8_K";
  }
  return fmt::format("type {}", static_cast<uint32_t>(t));
}

BlockSize block_size(TensorType t) {
  switch (t) {
    case TensorType::F32:
      return {1, 4};
    case TensorType::F16:
    case TensorType::BF16:
      return {1, 2};
    case TensorType::Q4_0:
      return {32, 18};
    case TensorType::Q4_1:
      return {32, 20};
    case TensorType::Q5_0:
      return {32, 22};
    case TensorType::Q5_1:
      return {32, 24};
    case TensorType::Q8_0:
      return {32, 34};
    case TensorType::Q4_K:
      return {256, 144};
    case TensorType::Q6_K:
      return {256, 210};
    default:
      return {0, 0};
  }
}

Value Value::u32(uint32_t v) {
  Value x;
  x.type = ValueType::UInt32;
  x.scalar = uint64_t{v};
  return x;
}
Value Value::i32(int32_t v) {
  Value x;
  x.type = ValueType::Int32;
  x.scalar = int64_t{v};
  return x;
}
Value Value::f32(float v) {
  Value x;
  x.type = ValueType::Float32;
  x.scalar = double{v};
  return x;
}
Value Value::boolean(bool v) {
  Value x;
  x.type = ValueType::Bool;
  x.scalar = v;
  return x;
}
Value Value::str(std::string v) {
  Value x;
  x.type = ValueType::String;
  x.scalar = std::move(v);
  return x;
}
Value Value::strings(std::vector<std::string> v) {
  Value x;
  x.type = ValueType::Array;
  x.array_type = ValueType::String;
  for (auto& s : v) x.array.emplace_back(std::move(s));
  return x;
}
Value Value::i32s(const std::vector<int32_t>& v) {
  Value x;
  x.type = ValueType::Array;
  x.array_type = ValueType::Int32;
  for (int32_t i : v) x.array.emplace_back(int64_t{i});
  return x;
}
Value Value::f32s(const std::vector<float>& v) {
  Value x;
  x.type = ValueType::Array;
  x.array_type = ValueType::Float32;
  for (float f : v) x.array.emplace_back(double{f});
  return x;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

// ---- writing -------------------------------------------------------------------------

namespace {

class Out {
 public:
  explicit Out(std::string& s) : s_(s) {}
  template <class T>
  void pod(T v) {
    s_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void str(const std::string& v) {
    pod<uint64_t>(v.size());
    s_ += v;
  }
  void element(ValueType t, const std::variant<uint64_t, int64_t, double, bool, std::string>& v) {
    switch (t) {
      case ValueType::UInt8:
        return pod<uint8_t>(static_cast<uint8_t>(std::get<uint64_t>(v)));
      case ValueType::Int8:
        return pod<int8_t>(static_cast<int8_t>(std::get<int64_t>(v)));
      case ValueType::UInt16:
        return pod<uint16_t>(static_cast<uint16_t>(std::get<uint64_t>(v)));
      case ValueType::Int16:
        return pod<int16_t>(static_cast<int16_t>(std::get<int64_t>(v)));
      case ValueType::UInt32:
        return pod<uint32_t>(static_cast<uint32_t>(std::get<uint64_t>(v)));
      case ValueType::Int32:
        return pod<int32_t>(static_cast<int32_t>(std::get<int64_t>(v)));
      case ValueType::Float32:
        return pod<float>(static_cast<float>(std::get<double>(v)));
      case ValueType::Bool:
        return pod<uint8_t>(std::get<bool>(v) ? 1 : 0);
      case ValueType::String:
        return str(std::get<std::string>(v));
      case ValueType::UInt64:
        return pod<uint64_t>(std::get<uint64_t>(v));
      case ValueType::Int64:
        return pod<int64_t>(std::get<int64_t>(v));
      case ValueType::Float64:
        return pod<double>(std::get<double>(v));
      case ValueType::Array:
        break;
    }
    DS_FAIL("gguf: an array cannot hold arrays");
  }

 private:
  std::string& s_;
};

}  // namespace

void Writer::set(const std::string& key, Value v) {
  for (auto& [k, old] : kv_)
    if (k == key) {
      old = std::move(v);
      return;
    }
  kv_.emplace_back(key, std::move(v));
}

void Writer::add_tensor(const std::string& name, TensorType type, std::vector<int64_t> ne,
                        std::function<void(std::function<void(const void*, size_t)>)> write) {
  const BlockSize b = block_size(type);
  DS_CHECK(b.elements > 0, "gguf: cannot write tensor '{}' of {}", name, type_name(type));
  DS_CHECK(!ne.empty() && ne.size() <= kMaxDims && ne[0] % b.elements == 0,
           "gguf: tensor '{}': {} rows of {} elements do not divide into {} blocks of {}", name, ne.size(),
           ne.empty() ? 0 : ne[0], type_name(type), b.elements);
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  tensors_.push_back({name, type, std::move(ne), static_cast<uint64_t>(n / b.elements * b.bytes), std::move(write)});
}

uint64_t Writer::write(const std::string& path) const {
  std::string head;
  Out o(head);
  o.pod<uint32_t>(kMagic);
  o.pod<uint32_t>(kVersion);
  o.pod<uint64_t>(tensors_.size());
  o.pod<uint64_t>(kv_.size());
  for (const auto& [key, v] : kv_) {
    o.str(key);
    o.pod<uint32_t>(static_cast<uint32_t>(v.type));
    if (v.type == ValueType::Array) {
      o.pod<uint32_t>(static_cast<uint32_t>(v.array_type));
      o.pod<uint64_t>(v.array.size());
      for (const auto& e : v.array) o.element(v.array_type, e);
    } else {
      o.element(v.type, v.scalar);
    }
  }
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    o.str(t.name);
    o.pod<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) o.pod<uint64_t>(static_cast<uint64_t>(d));
    o.pod<uint32_t>(static_cast<uint32_t>(t.type));
    o.pod<uint64_t>(offset);
    offset = align_up(offset + t.bytes, kAlignment);
  }
  head.resize(align_up(head.size(), kAlignment), '\0');
  AtomicFile f(path);
  f.write(head);
  uint64_t total = head.size();
  static const char zeros[kAlignment] = {};
  for (const auto& t : tensors_) {
    uint64_t written = 0;
    t.write([&](const void* p, size_t n) {
      f.write(p, n);
      written += n;
    });
    DS_CHECK(written == t.bytes, "gguf: tensor '{}' wrote {} bytes, not {}", t.name, written, t.bytes);
    const uint64_t pad = align_up(written, kAlignment) - written;
    f.write(zeros, pad);
    total += written + pad;
  }
  f.commit();
  return total;
}

// ---- reading -------------------------------------------------------------------------

struct Reader::Mapping {
  void* p = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (p) munmap(p, size);
  }
};

namespace {

class In {
 public:
  In(std::span<const uint8_t> b, const std::string& origin) : b_(b), origin_(origin) {}
  uint64_t pos() const { return pos_; }
  void need(uint64_t n, const char* what) const {
    DS_CHECK(n <= b_.size() - pos_, "GGUF file '{}': {} at byte {} runs past its end ({} bytes): truncated or not GGUF",
             origin_, what, pos_, b_.size());
  }
  template <class T>
  T pod(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const uint64_t n = pod<uint64_t>(what);
    DS_CHECK(n <= kMaxStringBytes, "GGUF file '{}': a {} of {} bytes", origin_, what, n);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  std::variant<uint64_t, int64_t, double, bool, std::string> element(ValueType t, const std::string& key) {
    switch (t) {
      case ValueType::UInt8:
        return uint64_t{pod<uint8_t>("a value")};
      case ValueType::Int8:
        return int64_t{pod<int8_t>("a value")};
      case ValueType::UInt16:
        return uint64_t{pod<uint16_t>("a value")};
      case ValueType::Int16:
        return int64_t{pod<int16_t>("a value")};
      case ValueType::UInt32:
        return uint64_t{pod<uint32_t>("a value")};
      case ValueType::Int32:
        return int64_t{pod<int32_t>("a value")};
      case ValueType::Float32:
        return double{pod<float>("a value")};
      case ValueType::Bool: {
        const uint8_t v = pod<uint8_t>("a value");
        DS_CHECK(v <= 1, "GGUF file '{}': key '{}' holds the bool {}", origin_, key, v);
        return v == 1;
      }
      case ValueType::String:
        return str("string");
      case ValueType::UInt64:
        return pod<uint64_t>("a value");
      case ValueType::Int64:
        return pod<int64_t>("a value");
      case ValueType::Float64:
        return pod<double>("a value");
      case ValueType::Array:
        break;
    }
    DS_FAIL("GGUF file '{}': key '{}' has value type {}", origin_, key, static_cast<uint32_t>(t));
  }
  // The smallest size one element of type t takes: bounds an array's count.
  static uint64_t min_bytes(ValueType t) {
    switch (t) {
      case ValueType::UInt8:
      case ValueType::Int8:
      case ValueType::Bool:
        return 1;
      case ValueType::UInt16:
      case ValueType::Int16:
        return 2;
      case ValueType::UInt32:
      case ValueType::Int32:
      case ValueType::Float32:
        return 4;
      default:
        return 8;
    }
  }
  size_t size() const { return b_.size(); }

 private:
  std::span<const uint8_t> b_;
  const std::string& origin_;
  uint64_t pos_ = 0;
};

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::Float64); }

}  // namespace

Reader Reader::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open GGUF file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    DS_FAIL("'{}' is not a regular file", path);
  }
  auto m = std::make_shared<Mapping>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size > 0) {
    void* p = mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int e = errno;
    ::close(fd);
    DS_CHECK(p != MAP_FAILED, "cannot map '{}': {}", path, std::strerror(e));
    m->p = p;
  } else {
    ::close(fd);
  }
  Reader r = parse({static_cast<const uint8_t*>(m->p), m->size}, path);
  r.map_ = std::move(m);
  return r;
}

Reader Reader::parse(std::span<const uint8_t> bytes, const std::string& origin) {
  Reader r;
  r.bytes_ = bytes;
  r.origin_ = origin;
  In in(bytes, r.origin_);
  DS_CHECK(bytes.size() >= 4 && in.pod<uint32_t>("the magic") == kMagic,
           "'{}' is not a GGUF file (it does not begin with \"GGUF\")", origin);
  r.version_ = in.pod<uint32_t>("the version");
  DS_CHECK(r.version_ == 2 || r.version_ == 3, "GGUF file '{}': version {} (this engine reads versions 2 and 3)",
           origin, r.version_);
  const uint64_t n_tensors = in.pod<uint64_t>("the tensor count"), n_kv = in.pod<uint64_t>("the key count");
  // Each key takes at least 12 bytes and each tensor info 24: counts past
  // what the file can hold are refused before anything is reserved.
  DS_CHECK(n_kv <= bytes.size() / 12 && n_tensors <= bytes.size() / 24,
           "GGUF file '{}': {} keys and {} tensors cannot fit in {} bytes", origin, n_kv, n_tensors, bytes.size());
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = in.str("key");
    const uint32_t t = in.pod<uint32_t>("a value type");
    DS_CHECK(known_value_type(t), "GGUF file '{}': key '{}' has value type {}", origin, key, t);
    Value v;
    v.type = static_cast<ValueType>(t);
    if (v.type == ValueType::Array) {
      const uint32_t et = in.pod<uint32_t>("an array type");
      DS_CHECK(known_value_type(et) && et != static_cast<uint32_t>(ValueType::Array),
               "GGUF file '{}': key '{}' is an array of type {}", origin, key, et);
      v.array_type = static_cast<ValueType>(et);
      const uint64_t count = in.pod<uint64_t>("an array length");
      DS_CHECK(count <= (bytes.size() - in.pos()) / In::min_bytes(v.array_type),
               "GGUF file '{}': key '{}' claims {} elements, more than the file holds", origin, key, count);
      v.array.reserve(count);
      for (uint64_t k = 0; k < count; ++k) v.array.push_back(in.element(v.array_type, key));
    } else {
      v.scalar = in.element(v.type, key);
    }
    DS_CHECK(r.kv_.emplace(key, std::move(v)).second, "GGUF file '{}': key '{}' is given twice", origin, key);
  }
  if (const Value* a = r.find("general.alignment")) {
    DS_CHECK(a->type == ValueType::UInt32, "GGUF file '{}': general.alignment must be a u32", origin);
    r.alignment_ = std::get<uint64_t>(a->scalar);
    DS_CHECK(r.alignment_ >= 1 && r.alignment_ <= 65536 && (r.alignment_ & (r.alignment_ - 1)) == 0,
             "GGUF file '{}': general.alignment {} is not a power of two up to 65536", origin, r.alignment_);
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    t.name = in.str("tensor name");
    const uint32_t dims = in.pod<uint32_t>("a tensor's dims");
    DS_CHECK(dims >= 1 && dims <= kMaxDims, "GGUF file '{}': tensor '{}' has {} dims (1 to {})", origin, t.name, dims,
             kMaxDims);
    int64_t numel = 1;
    for (uint32_t d = 0; d < dims; ++d) {
      const uint64_t n = in.pod<uint64_t>("a tensor dim");
      DS_CHECK(n >= 1 && n <= (uint64_t{1} << 40) && static_cast<uint64_t>(numel) <= (uint64_t{1} << 50) / n,
               "GGUF file '{}': tensor '{}' dim {} is {}", origin, t.name, d, n);
      t.ne.push_back(static_cast<int64_t>(n));
      numel *= static_cast<int64_t>(n);
    }
    t.type = static_cast<TensorType>(in.pod<uint32_t>("a tensor type"));
    t.offset = in.pod<uint64_t>("a tensor offset");
    const BlockSize b = block_size(t.type);
    if (b.elements > 0) {
      DS_CHECK(t.ne[0] % b.elements == 0, "GGUF file '{}': tensor '{}' ({}) has rows of {}, not a multiple of {}",
               origin, t.name, type_name(t.type), t.ne[0], b.elements);
      t.bytes = static_cast<uint64_t>(numel / b.elements * b.bytes);
    }
    DS_CHECK(t.offset % r.alignment_ == 0, "GGUF file '{}': tensor '{}' at offset {}, not a multiple of {}", origin,
             t.name, t.offset, r.alignment_);
    DS_CHECK(r.by_name_.emplace(t.name, r.tensors_.size()).second, "GGUF file '{}': tensor '{}' is given twice",
             origin, t.name);
    r.tensors_.push_back(std::move(t));
  }
  r.data_start_ = align_up(in.pos(), r.alignment_);
  const uint64_t data_bytes = r.data_start_ <= bytes.size() ? bytes.size() - r.data_start_ : 0;
  DS_CHECK(r.data_start_ <= bytes.size() || r.tensors_.empty(), "GGUF file '{}': no data section after the header",
           origin);
  std::vector<const TensorInfo*> order;
  for (const auto& t : r.tensors_) {
    DS_CHECK(t.offset <= data_bytes && t.bytes <= data_bytes - t.offset,
             "GGUF file '{}': tensor '{}' ({} bytes at {}) runs past the data section of {} bytes (truncated?)", origin,
             t.name, t.bytes, t.offset, data_bytes);
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < order.size(); ++i)
    DS_CHECK(order[i]->offset >= order[i - 1]->offset + order[i - 1]->bytes,
             "GGUF file '{}': tensors '{}' and '{}' overlap", origin, order[i - 1]->name, order[i]->name);
  return r;
}

const Value* Reader::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const TensorInfo* Reader::tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> Reader::data(const TensorInfo& t) const {
  DS_CHECK(block_size(t.type).elements > 0, "GGUF file '{}': tensor '{}' is {}, which this engine does not read",
           origin_, t.name, type_name(t.type));
  return bytes_.subspan(data_start_ + t.offset, t.bytes);
}

}  // namespace ds::io::gguf
