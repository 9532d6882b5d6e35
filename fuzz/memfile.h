// A file for fuzz targets whose reader takes a path: one in-memory file
// (memfd_create), rewritten with each input and named /proc/self/fd/N, so
// nothing is written to disk and nothing is left behind, even after a crash.
// Where memfd or /proc is missing, a temporary file under $TMPDIR (or /tmp)
// instead, removed when the process exits normally.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ds_fuzz {

class MemFile {
 public:
  MemFile() {
    fd_ = memfd_create("deepseek-fuzz", MFD_CLOEXEC);
    if (fd_ >= 0) {
      path_ = "/proc/self/fd/" + std::to_string(fd_);
      if (access(path_.c_str(), R_OK) == 0) return;
      ::close(fd_);
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/deepseek-fuzz-XXXXXX";
    fd_ = mkstemp(templ.data());
    if (fd_ < 0) {
      std::perror("deepseek fuzz: cannot create a temporary file");
      std::abort();
    }
    path_ = templ;
    temp_path() = templ;
    std::atexit([] { unlink(temp_path().c_str()); });
  }

  // Replaces the contents with `data`; returns the path to open.
  const std::string& write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) fail("ftruncate");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) fail("pwrite");
      done += static_cast<size_t>(n);
    }
    return path_;
  }

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] static void fail(const char* what) {
    std::perror(what);
    std::abort();
  }
  static std::string& temp_path() {
    static std::string p;
    return p;
  }

  int fd_ = -1;
  std::string path_;
};

}  // namespace ds_fuzz
