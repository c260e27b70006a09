// Element-wise combination shared by the communicators: the SAME code and
// order (rank 0, then rank 1, ...) everywhere, so every implementation gives
// bitwise the same answer. MAX/MIN propagate NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "leanstep/comm.h"
#include "leanstep/core.h"

namespace leanstep::comm::detail {

template <class T>
inline T combine_one(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::isnan(a) ? a : b;
      }
      return a > b ? a : b;
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::isnan(a) ? a : b;
      }
      return a < b ? a : b;
  }
  return a;
}

// acc[i] = combine(acc[i], x[i]) for n elements of `dtype` (fp32, fp64, int64).
inline void combine_into(void* acc, const void* x, DType dtype, int64_t n, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32: {
      auto* a = static_cast<float*>(acc);
      const auto* b = static_cast<const float*>(x);
      for (int64_t i = 0; i < n; ++i) a[i] = combine_one(a[i], b[i], op);
      break;
    }
    case DType::kFloat64: {
      auto* a = static_cast<double*>(acc);
      const auto* b = static_cast<const double*>(x);
      for (int64_t i = 0; i < n; ++i) a[i] = combine_one(a[i], b[i], op);
      break;
    }
    case DType::kInt64: {
      auto* a = static_cast<int64_t*>(acc);
      const auto* b = static_cast<const int64_t*>(x);
      for (int64_t i = 0; i < n; ++i) a[i] = combine_one(a[i], b[i], op);
      break;
    }
    default: break;
  }
}

inline void check_allreduce_arg(const Tensor& t, const char* where) {
  check_tensor(t, where, "inout");
  check_cpu(t, where, "inout");
  check_dtype(t, {DType::kFloat32, DType::kFloat64, DType::kInt64}, where, "inout");
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, "inout", "must be contiguous");
}

inline void check_broadcast_arg(const Tensor& t, int root, int size, const char* where) {
  check_tensor(t, where, "inout");
  check_cpu(t, where, "inout");
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, "inout", "must be contiguous");
  LEANSTEP_CHECK_ARG(root >= 0 && root < size, where, "root",
                     "must be a rank of the communicator (got " + std::to_string(root) + ")");
}

}  // namespace leanstep::comm::detail
