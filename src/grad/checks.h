// Argument checks shared by the fused ops and the reference path.
#pragma once

#include <fmt/format.h>

#include <cmath>

#include "grad/kernels.h"
#include "leanstep/comm.h"
#include "leanstep/core.h"

namespace leanstep::grad::detail {

// `cpu_only` false: the device backends' check on metadata (grad::check_scalar_arg).
inline void check_scalar(const Tensor& t, DType dtype, const char* where, const char* arg, bool cpu_only = true) {
  check_tensor(t, where, arg);
  if (cpu_only) check_cpu(t, where, arg);
  check_dtype(t, {dtype}, where, arg);
  LEANSTEP_CHECK_ARG(t.numel() == 1, where, arg, fmt::format("must have exactly 1 element (got {})", t.numel()));
}

inline void check_norm_type(double p, const char* where) {
  LEANSTEP_CHECK_ARG(p > 0, where, "norm_type", fmt::format("must be > 0 or inf (got {})", p));
}

inline void check_max_norm(double max_norm, const char* where) {
  LEANSTEP_CHECK_ARG(std::isfinite(max_norm) && max_norm >= 0, where, "max_norm",
                     fmt::format("must be finite and >= 0 (got {})", max_norm));
}

inline void check_grad_view(const Tensor& t, const char* where, const std::string& arg) {
  check_tensor(t, where, arg);
  check_cpu(t, where, arg);
  check_dtype(t, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}, where, arg);
}

void finish_norm(const Partial& local, NormKind kind, double p, const Tensor& out_norm, const Tensor* found_inf,
                 comm::Communicator* comm);
float clip_coefficient(float total_norm, double max_norm);

}  // namespace leanstep::grad::detail
