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

std::string resolve_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  DS_CHECK(!path.empty(), "the output path is empty");
  std::error_code ec;
  fs::path p(path);
  // Follow symlinks (a chain of them too) to the file they name.
  for (int hops = 0; fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    DS_CHECK(hops < 40, "output '{}': too many levels of symbolic links", path);
    const fs::path target = fs::read_symlink(p, ec);
    DS_CHECK(!ec, "output '{}': cannot read the symbolic link: {}", path, ec.message());
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  const fs::file_status st = fs::status(p, ec);
  if (fs::exists(st)) {
    DS_CHECK(fs::is_regular_file(st), "output '{}'{} exists and is not a regular file; refusing to replace it", path,
             p.string() == path ? "" : " (-> '" + p.string() + "')");
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  DS_CHECK(fs::is_directory(dir, ec), "output '{}': the folder '{}' does not exist", path, dir.string());
  DS_CHECK(::access(dir.c_str(), W_OK) == 0, "output '{}': the folder '{}' is not writable: {}", path, dir.string(),
           errno_text());
  return p.string();
}

void check_output_folder(const std::string& dir) {
  namespace fs = std::filesystem;
  DS_CHECK(!dir.empty(), "the output folder is empty");
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (fs::exists(st)) {
    DS_CHECK(fs::is_directory(st), "output folder '{}' exists and is not a folder", dir);
    DS_CHECK(::access(dir.c_str(), W_OK) == 0, "output folder '{}' is not writable: {}", dir, errno_text());
    return;
  }
  // Not there yet: the nearest existing ancestor must be a writable folder.
  fs::path up = fs::path(dir).parent_path();
  while (!up.empty() && !fs::exists(up, ec)) up = up.parent_path();
  if (up.empty()) up = ".";
  DS_CHECK(fs::is_directory(up, ec), "output folder '{}': '{}' is not a folder", dir, up.string());
  DS_CHECK(::access(up.c_str(), W_OK) == 0, "output folder '{}': '{}' is not writable: {}", dir, up.string(),
           errno_text());
}

AtomicFile::AtomicFile(const std::string& path) : path_(resolve_output_path(path)) {
  // Unique per process and per writer, so concurrent writers never share a temporary.
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path target(path_);
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
