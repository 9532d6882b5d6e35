// Files that appear whole or not at all: bytes go to a temporary file in the
// target's folder, which is flushed to disk and renamed over the target on
// commit(). A writer destroyed before commit() (an error, an exception)
// removes its temporary file and leaves any existing target untouched.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ds::io {

class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);  // ds::Error if the temporary cannot be created
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();  // fsync, close, rename over the target

 private:
  void abandon() noexcept;
  std::string path_, tmp_;
  int fd_ = -1;
};

// The whole of `data` as the file `path`, atomically.
void write_file_atomic(const std::string& path, std::string_view data);

}  // namespace ds::io
