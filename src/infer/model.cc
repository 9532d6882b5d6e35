#include "infer/model.h"

#include <fmt/format.h>
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "infer/engine.h"
#include "infer/v4_engine.h"
#include "model/gguf_import.h"

namespace ds::infer {

namespace {

std::mutex imported_mu;
std::map<std::string, std::string>& imported() {
  static std::map<std::string, std::string> m;
  return m;
}
void remove_imported() {
  std::error_code ec;
  for (const auto& [path, dir] : imported()) std::filesystem::remove_all(dir, ec);
}

}  // namespace

std::string model_folder(const std::string& path) {
  if (!model::is_gguf_file(path)) return path;
  std::lock_guard<std::mutex> lock(imported_mu);
  if (auto it = imported().find(path); it != imported().end()) return it->second;
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/deepseek-gguf-XXXXXX";
  DS_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot make a temporary folder for '{}' in '{}'", path, tmpl);
  try {
    model::import_gguf(path, tmpl);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(tmpl, ec);
    throw;
  }
  if (imported().empty()) std::atexit(remove_imported);
  imported()[path] = tmpl;
  std::fprintf(stderr, "%s", fmt::format("{}: a GGUF file, read into {} (float32 weights)\n", path, tmpl).c_str());
  return tmpl;
}

std::unique_ptr<Model> open_model(const std::string& dir, const ModelOptions& opt) {
  if (is_v4_folder(dir)) return open_v4_model(dir, opt);
  return open_v3_model(dir, opt);
}

}  // namespace ds::infer
