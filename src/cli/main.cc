// The `deepseek` program. Library errors (ds::Error) and command-line errors
// end here as one line on stderr and exit code 2.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/simd.h"
#include "core/system.h"
#include "dist/communicator.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/reference/matmul.h"
#include "ops/rmsnorm.h"

namespace {

// A short end-to-end check that the build works on this machine: the BLAS
// against the scalar reference, and an RMSNorm and attention forward producing
// finite numbers. The test suite is the real proof; this catches a broken
// install in seconds.
int run_selfcheck() {
  using namespace ds;
  const int64_t M = 37, N = 29, K = 53;
  std::vector<float> a(M * K), b(K * N), c(M * N);
  fill_normal(a.data(), M * K, 1.0f, 1);
  fill_normal(b.data(), K * N, 1.0f, 2);
  ops::matmul_forward(c.data(), a.data(), b.data(), M, N, K);
  auto want = ref::matmul<float>(a, b, M, N, K);
  double err = 0;
  for (size_t i = 0; i < c.size(); ++i) err = std::max(err, static_cast<double>(std::fabs(c[i] - want[i])));
  DS_CHECK(err < 1e-3, "selfcheck: matmul differs from the scalar reference by {}", err);
  fmt::print("matmul {}x{}x{}: max |err| vs scalar reference {:.2e}\n", M, N, K, err);

  std::vector<float> w(K, 1.0f), y(M * K), rstd(M);
  ops::rmsnorm_forward(y.data(), rstd.data(), a.data(), w.data(), M, K, 1e-6f);
  double ms = 0;
  for (int64_t j = 0; j < K; ++j) ms += static_cast<double>(y[j]) * y[j];
  DS_CHECK(std::fabs(ms / K - 1.0) < 1e-3, "selfcheck: rmsnorm output has mean square {}", ms / K);
  fmt::print("rmsnorm {}x{}: mean square of a normalized row {:.6f}\n", M, K, ms / K);

  ops::AttentionDims d{1, 64, 2, 24, 16, 0.2f};
  std::vector<float> q(64 * 2 * 24), kk(64 * 2 * 24), v(64 * 2 * 16), o(64 * 2 * 16), lse(2 * 64);
  fill_normal(q.data(), q.size(), 1.0f, 3);
  fill_normal(kk.data(), kk.size(), 1.0f, 4);
  fill_normal(v.data(), v.size(), 1.0f, 5);
  ops::attention_forward(o.data(), lse.data(), q.data(), kk.data(), v.data(), nullptr, d);
  // The first query attends only to itself: its output is v[0].
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 0; j < 16; ++j)
      DS_CHECK(std::fabs(o[h * 16 + j] - v[h * 16 + j]) < 1e-5, "selfcheck: attention of token 0 is not v[0]");
  fmt::print("attention T=64: first token equals its own value row; threads {}\n", num_threads());
  fmt::print("SIMD kernels: {} (DEEPSEEK_MAX_CPU_ISA caps it); bf16 dot products: {}\n", simd_target_name(),
             ops::bf16_dot_products() ? "yes" : "no");
  fmt::print("selfcheck passed\n");
  return 0;
}

// An error line as printed: runs of more than 24 digits (a crafted size, a
// number typed by mistake) are shortened, and the whole line is capped, so
// one bad value cannot flood the terminal.
std::string brief_error(std::string msg) {
  std::string out;
  for (size_t i = 0; i < msg.size();) {
    size_t j = i;
    while (j < msg.size() && msg[j] >= '0' && msg[j] <= '9') ++j;
    if (j - i > 24) {
      out += msg.substr(i, 12) + "...(" + std::to_string(j - i) + " digits)";
      i = j;
    } else if (j > i) {
      out += msg.substr(i, j - i);
      i = j;
    } else {
      out += msg[i++];
    }
  }
  if (out.size() > 2000) out = out.substr(0, 2000) + "...";
  return out;
}

// Under mpirun every rank's error line names its rank.
void print_error(const std::string& msg) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (!rank) rank = std::getenv("PMI_RANK");
  if (rank)
    std::fprintf(stderr, "deepseek: error (rank %s): %s\n", rank, brief_error(msg).c_str());
  else
    std::fprintf(stderr, "deepseek: error: %s\n", brief_error(msg).c_str());
}

}  // namespace

namespace ds::cli {
void check_stdout() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int err = errno;
    DS_FAIL("writing to standard output failed: {}", err ? std::strerror(err) : "unknown error");
  }
}

void add_selfcheck_command(CLI::App& app, CommandList& commands) {
  auto* cmd = app.add_subcommand("selfcheck", "run a quick numerical check of this build");
  commands.emplace_back(cmd, run_selfcheck);
}
}  // namespace ds::cli

// OpenMP threads that go to sleep between parallel regions must be woken by
// the kernel, and on virtual machines that wake-up costs more than a small
// decode-step product: measured on a 2-vCPU VM, decode ran at half speed
// (slower than one thread) whenever libgomp's spin count ran out. The
// program therefore spins its workers by default. libgomp reads its settings
// when it loads, before main, so they are set here and the program re-runs
// itself once. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is respected.
// A server waits for requests most of its life: its threads spin for a while
// (about a tenth of a second) after each parallel region, enough to bridge
// the steps of a generation, and then sleep.
static void default_to_spinning_threads(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") || std::getenv("DEEPSEEK_REEXEC")) return;
  if (std::find_if(argv + 1, argv + argc, [](const char* a) { return std::strcmp(a, "serve") == 0; }) != argv + argc)
    setenv("GOMP_SPINCOUNT", "4000000", 1);
  else
    setenv("OMP_WAIT_POLICY", "active", 1);
  setenv("DEEPSEEK_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // exec failed (no /proc): carry on with the library defaults.
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("GOMP_SPINCOUNT");
}

// A standard descriptor the caller closed (`>&-`) would be handed to the next
// file the program opens, and output meant for the terminal would land in
// it. Each closed one is reopened on /dev/null first, standard output
// read-only so that every write to it fails and is reported (check_stdout).
static void guard_standard_descriptors() {
  const int flags[3] = {O_RDONLY, O_RDONLY, O_WRONLY};
  for (int fd = 0; fd < 3; ++fd)
    if (fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int got = open("/dev/null", flags[fd]);
      if (got >= 0 && got != fd) close(got);  // not the lowest free one: give up on this descriptor
    }
}

int main(int argc, char** argv) {
  guard_standard_descriptors();
  default_to_spinning_threads(argc, argv);
  ds::keep_freed_memory_in_heap();
  CLI::App app{"deepseek.cpp: train and serve DeepSeek-V3-family models", "deepseek"};
  app.require_subcommand(0, 1);
  int threads = 0;
  // CLI::PositiveNumber would name DBL_MAX as the bound: the real bounds instead.
  app.add_option("--threads", threads, "worker threads (default: all cores)")->check(CLI::Range(1, 65536));
  std::string precision = "f32";
  app.add_option("--matmul-precision", precision,
                 "linear layers over bf16/fp8/fp4 weights: f32 (default) or bf16 (x rounded to bf16 first; "
                 "AVX512-BF16 dot products where the CPU has them)")
      ->check(CLI::IsMember({"f32", "float32", "bf16", "bfloat16"}));
  std::string quantized_x = "int8";
  app.add_option(
         "--quantized-x", quantized_x,
         "decode products over q4_k, q6_k and q8_0 weights: int8 (default; x rounded to 8 bits a block "
         "of 256 or 32, integer products, as llama.cpp) or f32 (x as it is: exactly what the dequantized weights "
         "compute)")
      ->check(CLI::IsMember({"int8", "f32", "float32"}));
  app.set_version_flag("--version", "deepseek.cpp 0.1.0");
  ds::cli::CommandList commands;
  ds::cli::add_selfcheck_command(app, commands);
  ds::cli::add_tokenizer_commands(app, commands);
  ds::cli::add_logits_command(app, commands);
  ds::cli::add_perplexity_command(app, commands);
  ds::cli::add_quantize_command(app, commands);
  ds::cli::add_model_commands(app, commands);
  ds::cli::add_prepare_command(app, commands);
  ds::cli::add_tokenizer_train_command(app, commands);
  ds::cli::add_train_commands(app, commands);
  ds::cli::add_serve_command(app, commands);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    print_error(std::string(e.what()) + " (see deepseek --help)");
    return 2;
  }
  try {
    if (threads > 0) ds::set_num_threads(threads);
    ds::ops::set_matmul_precision(ds::ops::parse_matmul_precision(precision));
    ds::ops::set_quantized_x(ds::ops::parse_quantized_x(quantized_x));
    ds::init_simd_targets();  // a bad DEEPSEEK_MAX_CPU_ISA is an error before any work
    int rc = -1;
    for (auto& [cmd, run] : commands)
      if (cmd->parsed()) {
        rc = run();
        break;
      }
    if (rc < 0) {
      std::fputs(app.help().c_str(), stdout);
      rc = 0;
    }
    // Output that did not reach its destination (a full disk, a closed
    // descriptor) is an error, never a silent success.
    ds::cli::check_stdout();
    return rc;
  } catch (const ds::Error& e) {
    print_error(e.what());
    ds::dist::exit_after_error(2);
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
    ds::dist::exit_after_error(2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deepseek: internal error: %s\n", brief_error(e.what()).c_str());
    ds::dist::exit_after_error(2);
  }
}
