// Reading text inputs: whole files, the glob patterns of corpus commands
// (`deepseek tokenizer train`, `deepseek prepare`), and JSON-lines documents.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ds::io {

// The whole file as bytes. ds::Error "cannot open WHAT 'PATH'" for a file
// that cannot be opened, and a clear error for a folder, anything else that
// is not a regular file (a device, a pipe) or a read failure.
std::string read_file(const std::string& path, const char* what);

// The files named by glob(3) patterns: each pattern's matches in glob's
// (sorted) order, patterns in the order given, a file named twice kept once;
// matches that are not regular files (folders) are skipped. ds::Error for no
// pattern, or a pattern that matches no regular file.
std::vector<std::string> expand_corpus_globs(const std::vector<std::string>& patterns);

// A corpus file is one document, except a `.jsonl` file: each non-blank line
// of it is a JSON object whose string field "text" is one document.
bool is_jsonl(const std::string& path);
bool is_blank_line(std::string_view line);
// The "text" of one .jsonl line; ds::Error naming `where` (file and line) for
// invalid UTF-8, invalid JSON, or no "text" string.
std::string jsonl_text(std::string_view line, const std::string& where);

}  // namespace ds::io
