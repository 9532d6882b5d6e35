#include "io/text_input.h"

#include <glob.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/tokenizer.h"

namespace ds::io {

std::string read_file(const std::string& path, const char* what) {
  // Checked before opening: opening a FIFO waits for a writer, and a device
  // or a pipe could be endless (/dev/zero). Files only.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st)) {
    DS_CHECK(!std::filesystem::is_directory(st), "{} '{}' is a folder, not a file", what, path);
    DS_CHECK(std::filesystem::is_regular_file(st), "{} '{}' is not a regular file", what, path);
  }
  std::ifstream in(path, std::ios::binary);
  DS_CHECK(in.good(), "cannot open {} '{}'", what, path);
  std::ostringstream ss;
  ss << in.rdbuf();
  DS_CHECK(!in.bad(), "error reading {} '{}'", what, path);
  return ss.str();
}

std::vector<std::string> expand_corpus_globs(const std::vector<std::string>& patterns) {
  DS_CHECK(!patterns.empty(), "no corpus input given");
  std::vector<std::string> files;
  std::set<std::string> have;
  for (const auto& p : patterns) {
    glob_t g{};
    const int rc = ::glob(p.c_str(), GLOB_ERR, nullptr, &g);
    std::vector<std::string> found;
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
    globfree(&g);
    DS_CHECK(rc != GLOB_NOSPACE, "out of memory expanding input pattern '{}'", p);
    DS_CHECK(rc != GLOB_ABORTED, "input pattern '{}': a folder could not be read", p);
    DS_CHECK(rc == 0 && !found.empty(), "input pattern '{}' matches no file", p);
    // Folders (and other non-files) a wildcard matches are skipped, so that
    // `corpus/*` works beside subfolders; a pattern must still name a file.
    size_t regular = 0;
    for (auto& f : found) {
      std::error_code ec;
      if (!std::filesystem::is_regular_file(f, ec)) continue;
      ++regular;
      if (have.insert(f).second) files.push_back(std::move(f));
    }
    DS_CHECK(regular > 0, "input pattern '{}' matches no regular file (only folders or other entries)", p);
  }
  return files;
}

bool is_jsonl(const std::string& path) { return std::filesystem::path(path).extension() == ".jsonl"; }

bool is_blank_line(std::string_view line) { return line.find_first_not_of(" \t\r\n") == std::string_view::npos; }

std::string jsonl_text(std::string_view line, const std::string& where) {
  check_utf8(line, where.c_str());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("{}: not valid JSON: {}", where, e.what());
  }
  DS_CHECK(j.is_object(), "{}: must be a JSON object with a \"text\" string, got {}", where, j.type_name());
  auto text = j.find("text");
  DS_CHECK(text != j.end() && text->is_string(), "{}: needs a \"text\" field holding a string", where);
  return text->get<std::string>();
}

}  // namespace ds::io
