// Tests for the error macros: DS_CHECK and DS_FAIL throw ds::Error carrying
// the formatted message, the source location relative to src/, and (for
// DS_CHECK) the failed condition; arguments are only evaluated on failure.
#include "core/error.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/tensor.h"

namespace ds {
namespace {
namespace error_test {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

int side_effects = 0;
int count_call() { return ++side_effects; }

TEST(Error, CheckThrowsWithMessageConditionAndLocation) {
  const int rows = 3, cols = 4;
  std::string msg;
  int line = 0;
  try {
    line = __LINE__ + 1;
    DS_CHECK(rows == cols, "matrix must be square, got {}x{} ({})", rows, cols, "hint: transpose");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_TRUE(contains(msg, "matrix must be square, got 3x4 (hint: transpose)")) << msg;
  EXPECT_TRUE(contains(msg, "rows == cols")) << msg;
  EXPECT_TRUE(contains(msg, "error_test.cc:" + std::to_string(line))) << msg;
  // The message comes first, so one-line reports lead with what went wrong.
  EXPECT_EQ(msg.rfind("matrix must be square", 0), 0u) << msg;
}

// What detail::fail (the function behind both macros) makes of a location.
std::string fail_message(const char* file, int line, const char* cond) {
  try {
    detail::fail(file, line, cond, "msg");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Error, LocationIsTrimmedToSrc) {
  // Only the path from src/ on is kept, whatever directory the tree was built in.
  EXPECT_EQ(fail_message("/any/checkout/src/core/tensor.cc", 1000, "a == b"),
            "msg [src/core/tensor.cc:1000: check `a == b` failed]");
  EXPECT_EQ(fail_message("src/io/reader.cc", 7, nullptr), "msg [src/io/reader.cc:7]");
  // A checkout that itself lives under a directory called src/.
  EXPECT_EQ(fail_message("/home/user/src/deepseek.cpp/src/io/reader.cc", 7, nullptr), "msg [src/io/reader.cc:7]");
  // Files outside src/ keep their path.
  EXPECT_EQ(fail_message("/repo/tests/x_test.cc", 3, nullptr), "msg [/repo/tests/x_test.cc:3]");
}

TEST(Error, LibraryErrorsNameTheirSourceFile) {
  // A real check inside the library reports its file under src/.
  std::string msg;
  try {
    Tensor::zeros({2, 2}, DType::F32).select(0, 5);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_TRUE(contains(msg, "[src/core/tensor.cc:")) << msg;
  EXPECT_TRUE(contains(msg, "select index 5")) << msg;
}

TEST(Error, FailThrowsWithoutCondition) {
  std::string msg;
  int line = 0;
  try {
    line = __LINE__ + 1;
    DS_FAIL("unsupported dtype {}", 42);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_TRUE(contains(msg, "unsupported dtype 42")) << msg;
  EXPECT_TRUE(contains(msg, "error_test.cc:" + std::to_string(line))) << msg;
  EXPECT_FALSE(contains(msg, "` failed]")) << msg;  // no condition part
}

TEST(Error, PassingCheckEvaluatesConditionOnceAndNoArguments) {
  side_effects = 0;
  int cond_evals = 0;
  DS_CHECK((++cond_evals, true), "never {}", count_call());
  EXPECT_EQ(cond_evals, 1);
  EXPECT_EQ(side_effects, 0);  // message arguments are only formatted on failure
  EXPECT_THROW(DS_CHECK((++cond_evals, false), "now {}", count_call()), Error);
  EXPECT_EQ(cond_evals, 2);
  EXPECT_EQ(side_effects, 1);
}

TEST(Error, IsARuntimeErrorAndBindsAsOneStatement) {
  EXPECT_THROW(DS_FAIL("x"), std::runtime_error);
  // The macro is a single statement, so it nests under an unbraced if/else.
  bool took_else = false;
  if (false)
    DS_CHECK(false, "unreachable");
  else
    took_else = true;
  EXPECT_TRUE(took_else);
}

}  // namespace error_test
}  // namespace
}  // namespace ds
