#include "io/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/text_input.h"

namespace ds::io {

// Shards are written and mapped as the host's integers, which are the
// format's little-endian ones on every machine this project builds for.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string errno_text() { return std::strerror(errno); }

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A non-negative JSON integer, or ds::Error naming `what`.
uint64_t get_count(const json& j, const char* key, const std::string& origin, const std::string& where) {
  DS_CHECK(j.is_object() && j.contains(key), "{}: {} lacks \"{}\"", origin, where, key);
  const json& v = j.at(key);
  DS_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0),
           "{}: {}.{} must be a non-negative integer, got {}", origin, where, key, v.dump());
  return v.get<uint64_t>();
}

std::optional<int32_t> get_optional_id(const json& j, const char* key, int64_t vocab, const std::string& origin) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  const uint64_t v = get_count(j, key, origin, "meta.json");
  DS_CHECK(static_cast<int64_t>(v) < vocab, "{}: {} {} is not below vocab_size {}", origin, key, v, vocab);
  return static_cast<int32_t>(v);
}

}  // namespace

std::string token_shard_name(const std::string& split, int64_t index) {
  return fmt::format("{}-{:05d}.tok", split, index);
}

void write_token_shard(const std::string& path, std::span<const uint64_t> offsets, std::span<const uint32_t> tokens) {
  DS_CHECK(!offsets.empty() && offsets.front() == 0 && offsets.back() == tokens.size(),
           "token shard '{}': offsets must run from 0 to the token count {}", path, tokens.size());
  for (size_t i = 1; i < offsets.size(); ++i)
    DS_CHECK(offsets[i] >= offsets[i - 1], "token shard '{}': offset {} decreases", path, i);
  unsigned char header[kTokenShardHeaderBytes];
  const uint32_t version = kTokenShardVersion, dtype = kTokenDtypeUint32;
  const uint64_t docs = offsets.size() - 1, count = tokens.size();
  std::memcpy(header, kTokenShardMagic, 8);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &dtype, 4);
  std::memcpy(header + 16, &docs, 8);
  std::memcpy(header + 24, &count, 8);
  AtomicFile f(path);
  f.write(header, sizeof header);
  f.write(offsets.data(), offsets.size_bytes());
  f.write(tokens.data(), tokens.size_bytes());
  f.commit();
}

TokenShard TokenShard::open(const std::string& path, int64_t vocab_limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open token shard '{}': {}", path, errno_text());
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    DS_FAIL("token shard '{}' is not a regular file", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kTokenShardHeaderBytes) {
    ::close(fd);
    DS_FAIL("token shard '{}' is {} bytes, shorter than the {}-byte header (truncated or not a token shard)", path,
            size, kTokenShardHeaderBytes);
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the contents reachable
  errno = map_errno;
  DS_CHECK(p != MAP_FAILED, "cannot map token shard '{}': {}", path, errno_text());
  TokenShard s;
  s.path_ = path;
  s.mapping_ = std::shared_ptr<void>(p, [size](void* q) { munmap(q, size); });
  const auto* b = static_cast<const unsigned char*>(p);

  DS_CHECK(std::memcmp(b, kTokenShardMagic, 8) == 0, "'{}' is not a token shard (bad magic bytes)", path);
  const uint32_t version = load<uint32_t>(b + 8), dtype = load<uint32_t>(b + 12);
  DS_CHECK(version == kTokenShardVersion, "token shard '{}' has format version {}; this build reads version {}", path,
           version, kTokenShardVersion);
  DS_CHECK(dtype == kTokenDtypeUint32, "token shard '{}' has token dtype code {}; only {} (uint32) is supported", path,
           dtype, kTokenDtypeUint32);
  const uint64_t docs = load<uint64_t>(b + 16), count = load<uint64_t>(b + 24);
  // Bound both counts by the file size before multiplying, so no product overflows.
  const uint64_t body = size - kTokenShardHeaderBytes;
  const bool fits = docs < body / 8 && count <= (body - 8 * (docs + 1)) / 4 &&
                    kTokenShardHeaderBytes + 8 * (docs + 1) + 4 * count == size;
  DS_CHECK(fits,
           "token shard '{}' is {} bytes, but its header promises {} documents and {} tokens (truncated or corrupt)",
           path, size, docs, count);
  s.num_docs_ = docs;
  s.num_tokens_ = count;
  s.offsets_ = reinterpret_cast<const uint64_t*>(b + kTokenShardHeaderBytes);
  s.tokens_ = reinterpret_cast<const uint32_t*>(b + kTokenShardHeaderBytes + 8 * (docs + 1));

  DS_CHECK(s.offsets_[0] == 0, "token shard '{}': the first document offset is {}, not 0", path, s.offsets_[0]);
  for (uint64_t i = 0; i < docs; ++i)
    DS_CHECK(s.offsets_[i + 1] >= s.offsets_[i] && s.offsets_[i + 1] <= count,
             "token shard '{}': document {} ends at offset {}, outside [{}, {}] (offsets must be non-decreasing and "
             "within the {} tokens)",
             path, i, s.offsets_[i + 1], s.offsets_[i], count, count);
  DS_CHECK(s.offsets_[docs] == count, "token shard '{}': the documents end at token {} but the shard holds {}", path,
           s.offsets_[docs], count);
  if (vocab_limit > 0) {
    uint32_t top = 0;
    for (uint64_t i = 0; i < count; ++i) top = std::max(top, s.tokens_[i]);
    if (count > 0 && top >= static_cast<uint64_t>(vocab_limit)) {
      const uint32_t* bad = std::find_if(s.tokens_, s.tokens_ + count,
                                         [&](uint32_t t) { return t >= static_cast<uint64_t>(vocab_limit); });
      const uint64_t at = static_cast<uint64_t>(bad - s.tokens_);
      const uint64_t doc =
          static_cast<uint64_t>(std::upper_bound(s.offsets_, s.offsets_ + docs + 1, at) - s.offsets_) - 1;
      DS_FAIL("token shard '{}': token {} (document {}) is id {}, not below the vocabulary size {}", path, at, doc,
              *bad, vocab_limit);
    }
  }
  return s;
}

std::span<const uint32_t> TokenShard::document(uint64_t i) const {
  DS_CHECK(i < num_docs_, "token shard '{}': document {} of {}", path_, i, num_docs_);
  return {tokens_ + offsets_[i], tokens_ + offsets_[i + 1]};
}

// ---------------------------------------------------------------------------
// meta.json

json TokenCorpusMeta::to_json() const {
  auto split_json = [](const TokenSplitInfo& s) {
    json shards = json::array();
    for (const auto& sh : s.shards)
      shards.push_back({{"file", sh.file}, {"documents", sh.documents}, {"tokens", sh.tokens}});
    return json{{"documents", s.documents}, {"tokens", s.tokens}, {"shards", shards}};
  };
  json j;
  j["format"] = kTokenCorpusFormat;
  j["version"] = version;
  j["token_dtype"] = "uint32";
  j["vocab_size"] = vocab_size;
  j["bos_id"] = bos_id ? json(*bos_id) : json(nullptr);
  j["eos_id"] = eos_id ? json(*eos_id) : json(nullptr);
  j["tokenizer"] = tokenizer;
  j["splits"] = {{"train", split_json(train)}, {"eval", split_json(eval)}};
  return j;
}

TokenCorpusMeta TokenCorpusMeta::from_json(const json& j, const std::string& origin) {
  DS_CHECK(j.is_object(), "{}: must be a JSON object, got {}", origin, j.type_name());
  // A string field's value, or "" when it is missing or not a string.
  auto text = [&](const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  DS_CHECK(text("format") == kTokenCorpusFormat, "{}: \"format\" is not \"{}\"", origin, kTokenCorpusFormat);
  TokenCorpusMeta m;
  const uint64_t version = get_count(j, "version", origin, "meta.json");
  DS_CHECK(version == kTokenCorpusVersion, "{}: format version {}; this build reads version {}", origin, version,
           kTokenCorpusVersion);
  DS_CHECK(text("token_dtype") == "uint32", "{}: token_dtype must be \"uint32\"", origin);
  const uint64_t vocab = get_count(j, "vocab_size", origin, "meta.json");
  DS_CHECK(vocab >= 1 && vocab <= (uint64_t{1} << 31), "{}: vocab_size {} is out of range", origin, vocab);
  m.vocab_size = static_cast<int64_t>(vocab);
  m.bos_id = get_optional_id(j, "bos_id", m.vocab_size, origin);
  m.eos_id = get_optional_id(j, "eos_id", m.vocab_size, origin);
  if (j.contains("tokenizer")) {
    DS_CHECK(j["tokenizer"].is_string(), "{}: \"tokenizer\" must be a string", origin);
    m.tokenizer = j["tokenizer"].get<std::string>();
  }
  DS_CHECK(j.contains("splits") && j["splits"].is_object(), "{}: \"splits\" must be an object", origin);
  for (const char* name : {"train", "eval"}) {
    TokenSplitInfo& s = name == std::string("train") ? m.train : m.eval;
    if (!j["splits"].contains(name)) continue;
    const json& sj = j["splits"][name];
    const std::string where = fmt::format("splits.{}", name);
    s.documents = get_count(sj, "documents", origin, where);
    s.tokens = get_count(sj, "tokens", origin, where);
    DS_CHECK(sj.contains("shards") && sj["shards"].is_array(), "{}: {}.shards must be an array", origin, where);
    uint64_t docs = 0, tokens = 0;
    for (size_t i = 0; i < sj["shards"].size(); ++i) {
      const json& sh = sj["shards"][i];
      const std::string at = fmt::format("{}.shards[{}]", where, i);
      TokenShardInfo info;
      DS_CHECK(sh.is_object() && sh.contains("file") && sh["file"].is_string(), "{}: {}.file must be a string", origin,
               at);
      info.file = sh["file"].get<std::string>();
      // Shard names are fixed, so meta.json cannot point outside the directory.
      DS_CHECK(info.file == token_shard_name(name, static_cast<int64_t>(i)), "{}: {}.file is '{}', expected '{}'",
               origin, at, info.file, token_shard_name(name, static_cast<int64_t>(i)));
      info.documents = get_count(sh, "documents", origin, at);
      info.tokens = get_count(sh, "tokens", origin, at);
      docs += info.documents;
      tokens += info.tokens;
      s.shards.push_back(std::move(info));
    }
    DS_CHECK(docs == s.documents && tokens == s.tokens,
             "{}: {} claims {} documents and {} tokens but its shards add up to {} and {}", origin, where, s.documents,
             s.tokens, docs, tokens);
  }
  return m;
}

TokenCorpusMeta TokenCorpusMeta::read(const std::string& dir) {
  std::error_code ec;
  DS_CHECK(fs::exists(dir, ec), "token directory '{}' does not exist", dir);
  DS_CHECK(fs::is_directory(dir, ec), "'{}' is not a directory (expected one written by `deepseek prepare`)", dir);
  const std::string path = (fs::path(dir) / "meta.json").string();
  DS_CHECK(fs::exists(path, ec),
           "'{}' has no meta.json: not a prepared token directory, or `deepseek prepare` did not finish "
           "(meta.json is written last)",
           dir);
  const std::string text = read_file(path, "token directory metadata");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DS_FAIL("'{}' is not valid JSON: {}", path, e.what());
  }
  return from_json(j, path);
}

const TokenSplitInfo& TokenCorpusMeta::split(const std::string& name) const {
  if (name == "train") return train;
  if (name == "eval") return eval;
  DS_FAIL("unknown split '{}' (expected train or eval)", name);
}

// ---------------------------------------------------------------------------
// Writing a corpus

TokenCorpusWriter::TokenCorpusWriter(const std::string& dir, uint64_t shard_tokens, int64_t vocab_size)
    : dir_(dir), shard_tokens_(shard_tokens), vocab_size_(vocab_size) {
  DS_CHECK(shard_tokens >= 1, "tokens per shard must be at least 1, got {}", shard_tokens);
  DS_CHECK(vocab_size >= 1 && vocab_size <= (int64_t{1} << 31), "vocab_size {} is out of range", vocab_size);
  check_output_folder(dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  DS_CHECK(!ec, "cannot create the output folder '{}': {}", dir, ec.message());
  // Until finish() writes a new meta.json the directory reads as incomplete.
  const fs::path meta = fs::path(dir) / "meta.json";
  if (fs::exists(fs::symlink_status(meta, ec))) {
    fs::remove(meta, ec);
    DS_CHECK(!ec, "cannot remove the old '{}': {}", meta.string(), ec.message());
  }
  train_.name = "train";
  eval_.name = "eval";
}

TokenCorpusWriter::Pending& TokenCorpusWriter::pending(const std::string& split) {
  if (split == "train") return train_;
  if (split == "eval") return eval_;
  DS_FAIL("unknown split '{}' (expected train or eval)", split);
}

void TokenCorpusWriter::add(const std::string& split, std::span<const int32_t> document) {
  DS_CHECK(!finished_, "token corpus '{}' is already finished", dir_);
  Pending& p = pending(split);
  for (int32_t id : document)
    DS_CHECK(id >= 0 && id < vocab_size_, "token id {} is outside the vocabulary [0, {})", id, vocab_size_);
  if (!p.tokens.empty() && p.tokens.size() + document.size() > shard_tokens_) flush(p);
  p.tokens.insert(p.tokens.end(), document.begin(), document.end());
  p.offsets.push_back(p.tokens.size());
}

void TokenCorpusWriter::flush(Pending& p) {
  if (p.offsets.size() == 1) return;  // no documents
  TokenShardInfo info{token_shard_name(p.name, static_cast<int64_t>(p.info.shards.size())), p.offsets.size() - 1,
                      p.tokens.size()};
  write_token_shard((fs::path(dir_) / info.file).string(), p.offsets, p.tokens);
  p.info.documents += info.documents;
  p.info.tokens += info.tokens;
  p.info.shards.push_back(std::move(info));
  p.offsets.assign(1, 0);
  p.tokens.clear();
}

TokenCorpusMeta TokenCorpusWriter::finish(TokenCorpusMeta meta) {
  DS_CHECK(!finished_, "token corpus '{}' is already finished", dir_);
  flush(train_);
  flush(eval_);
  finished_ = true;
  meta.version = kTokenCorpusVersion;
  meta.vocab_size = vocab_size_;
  meta.train = train_.info;
  meta.eval = eval_.info;
  // Shards of an earlier, larger run in the same directory.
  std::set<std::string> keep;
  for (const auto* s : {&meta.train, &meta.eval})
    for (const auto& sh : s->shards) keep.insert(sh.file);
  static const std::regex shard_re("(train|eval)-[0-9]{5,}\\.tok");
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (std::regex_match(name, shard_re) && !keep.count(name)) fs::remove(e.path(), ec);
  }
  write_file_atomic((fs::path(dir_) / "meta.json").string(), meta.to_json().dump(1) + "\n");
  return meta;
}

// ---------------------------------------------------------------------------
// Reading a split

TokenSplit TokenSplit::open(const std::string& dir, const std::string& split, int64_t vocab_limit) {
  TokenSplit s;
  s.meta_ = TokenCorpusMeta::read(dir);
  const TokenSplitInfo& info = s.meta_.split(split);
  const int64_t limit = vocab_limit > 0 ? std::min(vocab_limit, s.meta_.vocab_size) : s.meta_.vocab_size;
  for (const auto& sh : info.shards) {
    const std::string path = (fs::path(dir) / sh.file).string();
    std::error_code ec;
    DS_CHECK(fs::exists(path, ec), "token directory '{}': shard '{}' listed in meta.json is missing", dir, sh.file);
    TokenShard shard = TokenShard::open(path, limit);
    DS_CHECK(shard.num_documents() == sh.documents && shard.num_tokens() == sh.tokens,
             "token shard '{}' holds {} documents and {} tokens, but meta.json says {} and {}", path,
             shard.num_documents(), shard.num_tokens(), sh.documents, sh.tokens);
    s.num_tokens_ += shard.num_tokens();
    s.starts_.push_back(s.starts_.back() + shard.num_documents());
    s.shards_.push_back(std::move(shard));
  }
  return s;
}

std::span<const uint32_t> TokenSplit::document(uint64_t i) const {
  DS_CHECK(i < num_documents(), "document {} of {}", i, num_documents());
  const size_t shard = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin()) - 1;
  return shards_[shard].document(i - starts_[shard]);
}

}  // namespace ds::io
