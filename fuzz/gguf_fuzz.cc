// libFuzzer target for the GGUF reader (io/gguf.h). Any input must either be
// read or raise ds::Error; a file it reads must give every tensor's bytes
// inside the input. Built by fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON
// with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/gguf_fuzz -max_len=4096 fuzz/corpus/gguf
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto r = ds::io::gguf::Reader::parse({data, size}, "fuzz.gguf");
    volatile uint8_t sink = 0;
    for (const auto& t : r.tensors()) {
      if (ds::io::gguf::block_size(t.type).elements == 0) continue;
      const auto bytes = r.data(t);
      if (!bytes.empty()) sink = sink ^ bytes.front() ^ bytes.back();
    }
    (void)sink;
  } catch (const ds::Error&) {
  }
  return 0;
}
