// Status: a result code plus a human sentence. Every public entry point returns one.
#pragma once

#include <string>
#include <utility>

namespace flashcpp {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  ///< the caller passed something that can never be valid
  kUnsupported,      ///< valid in principle, but this build/backend/device cannot run it
  kCudaError,        ///< a CUDA runtime call failed (the sentence names it)
  kInternal,         ///< a bug in flashcpp: please report it
};

/// Name of a status code, e.g. "invalid_argument".
const char* status_code_name(StatusCode code) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status Invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status Cuda(std::string msg) { return {StatusCode::kCudaError, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

  bool ok() const noexcept { return code_ == StatusCode::kOk; }
  explicit operator bool() const noexcept { return ok(); }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  /// "invalid_argument: head_dim 84 is not supported (it must be a multiple of 8 in [8, 256])"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace flashcpp

/// Return early from the enclosing function if `expr` yields a non-ok Status.
#define FLASHCPP_RETURN_IF_ERROR(expr)            \
  do {                                            \
    ::flashcpp::Status _fc_st = (expr);           \
    if (!_fc_st.ok()) return _fc_st;              \
  } while (0)
