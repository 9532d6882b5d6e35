#include "infer/http_transport.h"

#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>
#include <thread>

namespace ds::infer::http {

namespace net = boost::asio;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

namespace {

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Bodies at least this large are followed by malloc_trim(0): glibc keeps
// the memory of freed large buffers in its arenas otherwise, and a burst of
// big bodies would stay resident.
constexpr size_t kTrimAfterBytes = size_t{256} << 10;

}  // namespace

// A connected socket as Beast's synchronous streams want it, with deadlines:
// reads fail with beast::error::timeout at the request's deadline (or with
// operation_aborted once the transport stops), a write that makes no
// progress for write_timeout_s fails with timeout. Also holds the
// connection's read buffer, so that pipelined bytes carry over.
class SocketStream {
 public:
  SocketStream(int fd, int stop_fd, double write_timeout_s)
      : fd_(fd), stop_fd_(stop_fd), write_timeout_s_(write_timeout_s) {}
  int fd() const { return fd_; }
  boost::beast::flat_buffer& buffer() { return buffer_; }
  void set_deadline(Clock::time_point t) { deadline_ = t; }

  template <class MutableBuffers>
  size_t read_some(const MutableBuffers& buffers, error_code& ec) {
    ec = {};
    net::mutable_buffer b;
    for (auto it = net::buffer_sequence_begin(buffers); it != net::buffer_sequence_end(buffers); ++it)
      if ((b = net::mutable_buffer(*it)).size() > 0) break;
    if (b.size() == 0) return 0;
    for (;;) {
      const ssize_t n = ::recv(fd_, b.data(), b.size(), MSG_DONTWAIT);
      if (n > 0) return static_cast<size_t>(n);
      if (n == 0) {
        ec = net::error::eof;
        return 0;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      if (!wait(POLLIN, deadline_, ec)) return 0;
    }
  }
  template <class MutableBuffers>
  size_t read_some(const MutableBuffers& buffers) {
    error_code ec;
    const size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers, error_code& ec) {
    ec = {};
    iovec iov[16];
    size_t k = 0;
    for (auto it = net::buffer_sequence_begin(buffers); it != net::buffer_sequence_end(buffers) && k < 16; ++it) {
      const net::const_buffer b(*it);
      if (b.size() > 0) iov[k++] = {const_cast<void*>(b.data()), b.size()};
    }
    if (k == 0) return 0;
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = k;
    const auto stall = after(write_timeout_s_);
    for (;;) {
      const ssize_t n = ::sendmsg(fd_, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) return static_cast<size_t>(n);
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      if (!wait(POLLOUT, stall, ec)) return 0;
    }
  }
  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers) {
    error_code ec;
    const size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  // Waits until the socket is ready for `events`, the deadline passes
  // (timeout), or, for reads, the transport stops (operation_aborted).
  bool wait(short events, Clock::time_point deadline, error_code& ec) const {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        ec = boost::beast::error::timeout;
        return false;
      }
      pollfd p[2] = {{fd_, events, 0}, {stop_fd_, POLLIN, 0}};
      const int n =
          ::poll(p, events == POLLIN && stop_fd_ >= 0 ? 2 : 1, static_cast<int>(std::min<int64_t>(left, 1000)));
      if (n < 0 && errno != EINTR) {
        ec = error_code(errno, boost::system::system_category());
        return false;
      }
      if (n > 0 && p[1].revents) {
        ec = net::error::operation_aborted;
        return false;
      }
      if (n > 0 && p[0].revents) return true;
    }
  }

 private:
  int fd_, stop_fd_;
  double write_timeout_s_;
  Clock::time_point deadline_ = Clock::time_point::max();
  boost::beast::flat_buffer buffer_;
};

// ---- responses ------------------------------------------------------------------

void Responder::send(int status, std::string body, std::string_view content_type) {
  if (on_answer) on_answer(status);
  bhttp::response<bhttp::string_body> res{static_cast<bhttp::status>(status), version_};
  res.set(bhttp::field::content_type, boost::beast::string_view(content_type.data(), content_type.size()));
  res.keep_alive(keep_alive_);
  res.body() = std::move(body);
  res.prepare_payload();
  error_code ec;
  if (finish_ && !res.body().empty()) {
    // All but the last byte, then finish(), then the last byte: a client
    // cannot have the answer before the request is finished. The answer is
    // freed first, so that a client slow to read that last byte holds no
    // more than this thread.
    std::ostringstream head;
    head << res.base();
    const std::string h = head.str();
    std::string& b = res.body();
    const char last = b.back();
    net::write(s_, std::array{net::const_buffer(h.data(), h.size()), net::const_buffer(b.data(), b.size() - 1)}, ec);
    std::string().swap(b);
    finish();
    if (!ec) net::write(s_, net::buffer(&last, 1), ec);
  } else {
    finish();
    bhttp::write(s_, res, ec);
  }
  answered_ = true;
  status_ = status;
  failed_ = failed_ || ec;
}

bool Responder::begin_chunks(int status, std::string_view content_type, std::string_view cache_control) {
  if (on_answer) on_answer(status);
  bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(status), version_};
  res.set(bhttp::field::content_type, boost::beast::string_view(content_type.data(), content_type.size()));
  res.set(bhttp::field::cache_control, boost::beast::string_view(cache_control.data(), cache_control.size()));
  // HTTP/1.0 has no chunks: the body runs to the end of the connection.
  if (version_ >= 11) res.chunked(true);
  if (version_ < 11) keep_alive_ = false;
  res.keep_alive(keep_alive_);
  bhttp::response_serializer<bhttp::empty_body> sr{res};
  error_code ec;
  bhttp::write_header(s_, sr, ec);
  answered_ = true;
  status_ = status;
  failed_ = failed_ || ec;
  return !failed_;
}

bool Responder::chunk(std::string_view data) {
  if (failed_ || data.empty()) return !failed_;
  error_code ec;
  if (version_ >= 11)
    net::write(s_, bhttp::make_chunk(net::buffer(data.data(), data.size())), ec);
  else
    net::write(s_, net::buffer(data.data(), data.size()), ec);
  failed_ = failed_ || ec;
  return !failed_;
}

bool Responder::end_chunks() {
  // HTTP/1.0's stream ends when the connection closes, after the request.
  finish();
  if (failed_ || version_ < 11) return !failed_;
  error_code ec;
  net::write(s_, bhttp::make_chunk_last(), ec);
  failed_ = failed_ || ec;
  return !failed_;
}

bool Responder::peer_gone() const {
  pollfd p{s_.fd(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

int Responder::socket() const { return s_.fd(); }

// ---- the transport ------------------------------------------------------------

Transport::Transport(TransportOptions opt, Handler handler, ErrorBody error_body)
    : opt_(std::move(opt)), handler_(std::move(handler)), error_body_(std::move(error_body)) {
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

Transport::~Transport() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

int Transport::bind() {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (::getaddrinfo(opt_.host.c_str(), std::to_string(opt_.port).c_str(), &hints, &res) != 0) return -1;
  int port = -1;
  for (addrinfo* a = res; a && port < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    // SO_REUSEADDR only: with SO_REUSEPORT a second server on the same port
    // would share it instead of failing.
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
    port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  ::freeaddrinfo(res);
  return port;
}

void Transport::stop() {
  stopping_ = true;
  const uint64_t one = 1;
  if (stop_fd_ >= 0) [[maybe_unused]]
    auto n = ::write(stop_fd_, &one, sizeof one);
}

void Transport::run() {
  while (listen_fd_ >= 0 && !stopping_) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[1].revents) break;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors: let the open connections end some.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    {
      std::lock_guard lk(mu_);
      if (connections_ >= opt_.max_connections) {
        refuse_at_once(fd, "the server has as many connections open as it takes; try again later");
        continue;
      }
      ++connections_;
    }
    auto done = [this] {
      std::lock_guard lk(mu_);
      if (--connections_ == 0) idle_.notify_all();
    };
    try {
      std::thread([this, fd, done] {
        serve(fd);
        done();
      }).detach();
    } catch (const std::system_error&) {
      done();
      refuse_at_once(fd, "the server cannot take another connection now; try again later");
    }
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  std::unique_lock lk(mu_);
  idle_.wait(lk, [this] { return connections_ == 0; });
}

void Transport::serve(int fd) {
  int yes = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // fails harmlessly on other sockets
  SocketStream s(fd, stop_fd_, opt_.write_timeout_s);
  for (bool open = true; open && !stopping_;) {
    // An idle connection waits idle_timeout_s for its next request; from
    // its first byte, the request has request_timeout_s in all.
    if (s.buffer().size() == 0) {
      error_code ec;
      if (!s.wait(POLLIN, after(opt_.idle_timeout_s), ec)) break;
    }
    s.set_deadline(after(opt_.request_timeout_s));
    bool large = false;
    open = serve_one(s, large);
    if (large) ::malloc_trim(0);
  }
  linger_close(fd);
}

namespace {

// A request slot (Transport::max_requests), held while a body is read and
// its request is handled. A request refused for want of one takes none
// while its 503 is written: it would crowd out a request within the limit.
class Slot {
 public:
  Slot(std::atomic<int>& used, int max) : used_(used) {
    int n = used_.load();
    while (n < max && !used_.compare_exchange_weak(n, n + 1)) {
    }
    held_ = n < max;
  }
  ~Slot() {
    if (held_) --used_;
  }
  bool held() const { return held_; }

 private:
  std::atomic<int>& used_;
  bool held_;
};

}  // namespace

bool Transport::serve_one(SocketStream& s, bool& large) {
  bhttp::request_parser<bhttp::string_body> p;
  p.header_limit(static_cast<uint32_t>(std::min<size_t>(opt_.max_header_bytes, UINT32_MAX)));
  p.body_limit(opt_.max_body_bytes);
  error_code ec;
  bhttp::read_header(s, s.buffer(), p, ec);
  if (!ec) {
    const auto& h = p.get();
    // RFC 9112 6.3: a request whose Transfer-Encoding does not end in
    // chunked has no length the server could know.
    if (h.count(bhttp::field::transfer_encoding) && !p.chunked())
      return refuse(s, 400, "malformed request: a Transfer-Encoding other than chunked");
    const bool has_body = p.chunked() || p.content_length().value_or(0) > 0;
    std::optional<Slot> slot;
    if (has_body) {
      slot.emplace(requests_, opt_.max_requests);
      if (!slot->held())
        return refuse(s, 503, "the server is answering as many requests as it takes at once; try again later");
      if (boost::beast::iequals(h[bhttp::field::expect], "100-continue")) {
        bhttp::response<bhttp::empty_body> cont{bhttp::status::continue_, h.version()};
        bhttp::write(s, cont, ec);
      }
      if (!ec) bhttp::read(s, s.buffer(), p, ec);
      large = p.get().body().size() >= kTrimAfterBytes || ec == bhttp::error::body_limit;
    }
    if (!ec) {
      Request req = p.release();
      // The slot is given back (and the body freed) before the last byte
      // of the answer goes out, not when this thread next runs: a client
      // that waits for each answer before its next request never finds its
      // own last request still counted, not even on a loaded machine.
      std::function<void()> finish;
      if (slot)
        finish = [&] {
          std::string().swap(req.body());
          slot.reset();
        };
      Responder out(s, req.version(), req.keep_alive() && !stopping_, std::move(finish));
      handler_(req, out);
      if (!out.answered()) out.send(500, error_body_(500, "internal error: the request got no answer"));
      return out.keep_alive() && !stopping_;
    }
  }
  if (ec == bhttp::error::end_of_stream || ec == net::error::operation_aborted || ec == net::error::connection_reset ||
      ec == net::error::broken_pipe)
    return false;  // nothing to answer, or nobody to answer
  if (ec == bhttp::error::body_limit)
    return refuse(s, 413,
                  "the request body is too large (the limit is " + std::to_string(opt_.max_body_bytes) +
                      " bytes, chunked or not)");
  if (ec == bhttp::error::header_limit)
    return refuse(s, 431,
                  "the request header is too large (the limit is " + std::to_string(opt_.max_header_bytes) + " bytes)");
  if (ec == boost::beast::error::timeout) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", opt_.request_timeout_s);
    return refuse(s, 408, std::string("the request did not arrive within ") + secs + " s");
  }
  if (ec == bhttp::error::partial_message) return refuse(s, 400, "the connection ended in the middle of the request");
  return refuse(s, 400, "malformed request: " + ec.message());
}

bool Transport::refuse(SocketStream& s, int status, const std::string& message) {
  Responder out(s, 11, false);
  out.send(status, error_body_(status, message));
  return false;
}

void Transport::refuse_at_once(int fd, const std::string& message) {
  SocketStream s(fd, -1, 0.2);
  refuse(s, 503, message);
  ::shutdown(fd, SHUT_WR);
  ::close(fd);
}

// Ends the connection: no more writes, then what the client still sends is
// read and dropped for up to a second before the socket closes, so that
// closing with unread bytes (a body refused half way) does not reset the
// connection before the client read the answer.
void Transport::linger_close(int fd) const {
  ::shutdown(fd, SHUT_WR);
  const auto until = after(1.0);
  char scratch[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    const ssize_t n = ::recv(fd, scratch, sizeof scratch, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
  ::close(fd);
}

}  // namespace ds::infer::http
