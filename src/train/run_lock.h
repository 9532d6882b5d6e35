// One trainer per run folder: rank 0 holds an exclusive flock(2) on
// RUN/run.lock for the whole run, and writes its pid and host into it so that
// a second trainer (a resume=true started by hand, a scheduler's requeue) is
// refused at once with one line naming the holder. The kernel drops the lock
// when the process ends, however it ends; the file itself stays.
#pragma once

#include <string>

namespace ds::train {

class RunLock {
 public:
  // Takes the lock of the folder `run_dir` (which must exist); ds::Error when
  // another process (or another RunLock of this one) holds it.
  explicit RunLock(const std::string& run_dir);
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();

  static constexpr const char* kFileName = "run.lock";

 private:
  int fd_ = -1;
};

}  // namespace ds::train
