// libFuzzer target for the server's request path. The first byte picks what
// the rest is:
//   even: a request body, read as /v1/completions (byte & 2: as
//         /v1/chat/completions, in the chat format (byte >> 2) & 3) by
//         infer/server_api (the depth scan, the JSON parse, every field's
//         check, the prompt through the tiny test tokenizer). It must either
//         give a request that fits the model or throw api::Refusal, whose
//         error object must be one line of JSON. A chat request that passes
//         has the body's bytes read as its answer (infer/chat_parse.h), whole
//         and in two pieces: both must give the same reasoning, content and
//         calls.
//   odd:  the bytes a client sends on one connection, served by
//         http::Transport::serve over a socketpair (Beast's parser, the
//         header and body limits, chunked bodies, pipelining, the transport's
//         own refusals) with a handler that checks bodies as above. What
//         comes back must be a sequence of whole HTTP responses, each with a
//         known status and a JSON body, errors as OpenAI's error object.
// Anything else (a crash, a sanitizer report, another exception, an answer
// that does not parse) is a finding. Built by fuzz/CMakeLists.txt
// (cmake -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/server_request_fuzz -max_len=4096 -dict=fuzz/server_request.dict fuzz/corpus/server_request
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/buffer.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "infer/chat_parse.h"
#include "infer/http_transport.h"
#include "infer/server_api.h"
#include "io/text_input.h"
#include "io/tokenizer.h"
#include "json_mutator.h"

namespace {

namespace api = ds::infer::api;
namespace http = ds::infer::http;
namespace bhttp = boost::beast::http;
constexpr int64_t kPositions = 128;

// The tiny test tokenizer with DeepSeek's chat and call tokens added, so
// that chat requests reach the chat formats.
const ds::io::Tokenizer& tokenizer() {
  static const auto tok = [] {
    auto t = api::json::parse(
        ds::io::read_file(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json", "tokenizer"));
    int id = 292;
    for (const char* content :
         {"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
          "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
          "<｜tool▁output▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"})
      t["added_tokens"].push_back({{"id", id++},
                                   {"content", content},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", false},
                                   {"special", false}});
    return ds::io::Tokenizer::from_json(t.dump());
  }();
  return tok;
}

void check_error_text(const std::string& text) {
  const auto e = api::json::parse(text);  // throws (a finding) if not JSON
  const auto& m = e.at("error").at("message");
  if (!m.is_string() || m.get<std::string>().find('\n') != std::string::npos) std::abort();
}

namespace chat = ds::infer::chat;

// The bytes read as the answer to a chat request: whole, and cut in two
// where the text's length says, alike.
void check_answer(chat::Format f, const chat::Prompt& p, std::string_view text) {
  const chat::Piece whole = chat::parse_answer(f, p, text);
  chat::AnswerParser parser(f, p);
  const size_t cut = text.size() / 2;
  chat::Piece split = parser.push(text.substr(0, cut));
  split.append(parser.push(text.substr(cut)));
  split.append(parser.finish());
  if (split.reasoning != whole.reasoning || split.content != whole.content || split.calls.size() != whole.calls.size())
    std::abort();
}

// The body checked as the server checks it: the status and body to answer.
std::pair<int, std::string> answer(std::string_view body, bool is_chat, chat::Format format = chat::Format::V3) {
  try {
    const api::json j = api::parse_body(body);
    // The chat format alone, whatever the prompt's length: a rendered
    // conversation's answer parser gets the body's bytes.
    if (is_chat) {
      try {
        const auto ordered = chat::ojson::parse(body);
        const chat::ojson tools = ordered.contains("tools") ? ordered["tools"] : chat::ojson();
        check_answer(format, chat::render(format, chat::read_conversation(j, tools, format)), body);
      } catch (const chat::Invalid& e) {
        if (e.message.empty() || e.message.find('\n') != std::string::npos) std::abort();
      }
    }
    const api::Request r =
        api::read_request(j, is_chat, {&tokenizer(), kPositions, tokenizer().vocab_size(), format}, body);
    const auto n = static_cast<int64_t>(r.batch.prompt.size());
    if (n < 1 || n > kPositions || r.batch.max_new_tokens < 0) std::abort();
    // What the batcher would refuse with an error the server did not name.
    if (r.n < 1 || r.n > api::kMaxChoices || r.batch.top_logprobs > ds::infer::kMaxTopLogprobs) std::abort();
    ds::infer::check_adjust(r.batch.adjust, tokenizer().vocab_size());
    return {200, "{}"};
  } catch (const api::Refusal& e) {
    if (e.status < 400 || e.status > 599) std::abort();
    std::string text = api::error_text(e);
    check_error_text(text);
    return {e.status, std::move(text)};
  }
}

http::Transport& transport() {
  static http::Transport t(
      [] {
        http::TransportOptions o;
        o.max_body_bytes = 2048;
        o.max_header_bytes = 1024;
        o.write_timeout_s = 0.2;
        return o;
      }(),
      [](const http::Request& req, http::Responder& out) {
        const auto target = req.target();
        const std::string_view path(target.data(), target.size());
        if (req.method() == bhttp::verb::post && (path == "/v1/completions" || path == "/v1/chat/completions")) {
          auto [status, body] = answer(req.body(), path == "/v1/chat/completions");
          out.send(status, std::move(body));
        } else {
          out.send(404, api::error_text({404, "no route", ""}));
        }
      },
      [](int status, const std::string& message) {
        return api::error_text({status, message, ""});
      });
  return t;
}

// The responses a connection got, each checked.
void check_responses(const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    bhttp::response_parser<bhttp::string_body> p;
    p.eager(true);
    boost::system::error_code ec;
    while (!p.is_done()) {
      const size_t used = p.put(boost::asio::buffer(data.data() + off, data.size() - off), ec);
      off += used;
      if (ec || used == 0) std::abort();  // a response cut short or malformed
    }
    const int status = p.get().result_int();
    if (status == 100) continue;  // the interim answer to Expect: 100-continue
    const bool known = status == 200 || status == 400 || status == 404 || status == 408 || status == 413 ||
                       status == 431 || status == 503;
    if (!known) std::abort();
    if (status == 200)
      (void)api::json::parse(p.get().body());
    else
      check_error_text(p.get().body());
  }
}

void serve_bytes(std::string_view bytes) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
  const int big = 1 << 20;
  ::setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  ::setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  if (::write(sv[0], bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) std::abort();
  ::shutdown(sv[0], SHUT_WR);
  transport().serve(sv[1]);  // closes sv[1]
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = ::read(sv[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(sv[0]);
  check_responses(out);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1)
    serve_bytes(rest);
  else
    answer(rest, data[0] & 2, chat::kFormats[(data[0] >> 2) & 3]);
  return 0;
}

// Half JSON-aware node mutations of the part after the mode byte
// (fuzz/json_mutator.h), half libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/1, /*split_nul=*/false);
}
