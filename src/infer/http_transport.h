// The server's HTTP/1.1 connections, over Boost.Beast's parser and
// serializer: one thread per connection, every read and write with a
// deadline, requests on one connection (pipelined or not) answered in order.
//
// What a client can hold is bounded: connections (max_connections; beyond
// them 503 at once), the time to send one request's header and body
// (request_timeout_s in all, however slowly the bytes come; then 408), the
// header (max_header_bytes; 431) and the body, chunked or not
// (max_body_bytes; 413), and requests with a body handled at once
// (max_requests, each from its header until its answer is finished; beyond
// them 503). Framing errors (a malformed request line or header, conflicting
// Content-Length headers, a bad chunk) are answered at once with 400. Each of
// these answers is OpenAI's error object and closes the connection.
#pragma once

#include <atomic>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace ds::infer::http {

namespace bhttp = boost::beast::http;
using Request = bhttp::request<bhttp::string_body>;

struct TransportOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  int max_connections = 256;
  int max_requests = 32;
  size_t max_body_bytes = size_t{8} << 20;
  size_t max_header_bytes = size_t{16} << 10;
  double request_timeout_s = 10;  // one request's header and body, in all
  double idle_timeout_s = 5;      // waiting for the next request on a connection
  double write_timeout_s = 30;    // a write that makes no progress for this long fails
};

class SocketStream;

// How a handler answers one request: a whole response, or a head and then
// chunks (a stream). After a failed write the connection ends.
//
// `finish` runs once, before the client can have the whole answer: before
// the last byte of a whole response, before the last chunk of a stream. The
// transport gives the request's slot back there (and frees its body), so
// that a client that has its answer and sends its next request finds the
// slot free, however late the scheduler runs this thread again.
class Responder {
 public:
  Responder(SocketStream& s, unsigned version, bool keep_alive, std::function<void()> finish = {})
      : s_(s), version_(version), keep_alive_(keep_alive), finish_(std::move(finish)) {}
  void send(int status, std::string body, std::string_view content_type = "application/json");
  bool begin_chunks(int status, std::string_view content_type, std::string_view cache_control = "no-cache");
  bool chunk(std::string_view data);
  bool end_chunks();
  // Whether the client closed its side of the connection (or reset it).
  bool peer_gone() const;
  int socket() const;
  bool answered() const { return answered_; }
  // The status sent (0: none yet, or abandoned).
  int status() const { return status_; }
  bool failed() const { return failed_; }
  bool keep_alive() const { return keep_alive_ && !failed_; }
  // Answers nothing and ends the connection (the client has gone).
  void abandon() { answered_ = failed_ = true; }
  // Called with the status just before a response's head is written (so a
  // count of answers is up to date when the client reads the answer).
  std::function<void(int status)> on_answer;

 private:
  void finish() {
    if (finish_) std::exchange(finish_, nullptr)();
  }

  SocketStream& s_;
  unsigned version_;
  bool keep_alive_, answered_ = false, failed_ = false;
  int status_ = 0;
  std::function<void()> finish_;
};

// The request's body is freed when its answer is finished (see Responder):
// a handler reads it before it answers.
using Handler = std::function<void(const Request&, Responder&)>;
// The body of an error response: OpenAI's error object for this status and message.
using ErrorBody = std::function<std::string(int status, const std::string& message)>;

class Transport {
 public:
  Transport(TransportOptions opt, Handler handler, ErrorBody error_body);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Listens on host:port; returns the port, or -1 when it cannot.
  int bind();
  // Accepts connections until stop(), then waits for the open ones to end.
  void run();
  // From any thread, before or during run(): no more requests are read;
  // responses being written are finished.
  void stop();
  bool stopping() const { return stopping_; }

  // Serves one connected socket until the connection ends, and closes it.
  // run() calls it on a thread per connection; fuzzers call it directly.
  void serve(int fd);

 private:
  bool serve_one(SocketStream& s, bool& large);
  bool refuse(SocketStream& s, int status, const std::string& message);
  void refuse_at_once(int fd, const std::string& message);
  void linger_close(int fd) const;

  const TransportOptions opt_;
  Handler handler_;
  ErrorBody error_body_;
  int listen_fd_ = -1, stop_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> requests_{0};
  std::mutex mu_;
  std::condition_variable idle_;
  int connections_ = 0;
};

}  // namespace ds::infer::http
