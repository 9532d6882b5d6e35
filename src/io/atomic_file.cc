#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace ds::io {

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  // Unique per process and per writer, so concurrent writers never share a temporary.
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path target(path);
  tmp_ = (target.parent_path() /
          (target.filename().string() + ".tmp." + std::to_string(getpid()) + "." + std::to_string(counter++)))
             .string();
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DS_CHECK(fd_ >= 0, "cannot create '{}': {}", tmp_, errno_text());
}

AtomicFile::~AtomicFile() { abandon(); }

void AtomicFile::abandon() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
  }
}

void AtomicFile::write(const void* data, size_t n) {
  DS_CHECK(fd_ >= 0, "write to '{}' after it was committed or failed", path_);
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string err = errno_text();
      abandon();
      DS_FAIL("writing '{}' failed: {}", path_, err);
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
}

void AtomicFile::commit() {
  DS_CHECK(fd_ >= 0, "'{}' was already committed or failed", path_);
  const int synced = ::fsync(fd_);
  const int closed = ::close(fd_);
  fd_ = -1;
  if (synced != 0 || closed != 0) {
    const std::string err = errno_text();
    ::unlink(tmp_.c_str());
    DS_FAIL("flushing '{}' failed: {}", path_, err);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp_.c_str());
    DS_FAIL("renaming '{}' to '{}' failed: {}", tmp_, path_, err);
  }
}

void write_file_atomic(const std::string& path, std::string_view data) {
  AtomicFile f(path);
  f.write(data);
  f.commit();
}

}  // namespace ds::io
