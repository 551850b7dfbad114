// The one error convention of jax_ep's C++ library: a code and a message that names the op, the argument, and
// the expected and actual values. ffi/xla turns it into ffi::Error, the nanobind module into exceptions.
#pragma once

#include <string>
#include <utility>

namespace jax_ep {

enum class StatusCode { kOk, kInvalidArgument, kFailedPrecondition, kResourceExhausted, kDeadlineExceeded, kInternal };

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
  static Status Error(StatusCode code, std::string message) { return {code, std::move(message)}; }
  static Status Internal(std::string message) { return {StatusCode::kInternal, std::move(message)}; }
  static Status InvalidArgument(std::string message) { return {StatusCode::kInvalidArgument, std::move(message)}; }
};

}  // namespace jax_ep
