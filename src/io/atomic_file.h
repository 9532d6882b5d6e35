// Files that appear whole or not at all: bytes go to a temporary file in the
// target's folder, which is flushed to disk and renamed over the target on
// commit(). A writer destroyed before commit() (an error, an exception)
// removes its temporary file and leaves any existing target untouched.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ds::io {

// The file an output path names, checked before any expensive work: a
// symlink is followed to the file it names (the link stays, its target is
// replaced); the result must be a regular file or not exist yet, and its
// folder must exist and be writable. Anything else (a folder, a FIFO, a
// device, a socket, a missing folder) is a ds::Error naming the path, so an
// output never replaces a node that is not a plain file.
std::string resolve_output_path(const std::string& path);

// The same for an output folder: it must be a folder or not exist yet, and
// its parent must exist and be writable when it does not.
void check_output_folder(const std::string& dir);

class AtomicFile {
 public:
  // Resolves `path` with resolve_output_path; ds::Error if that refuses it or
  // the temporary cannot be created.
  explicit AtomicFile(const std::string& path);
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
