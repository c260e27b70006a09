// Internal helpers shared by the reference and fused RMSNorm: argument
// validation (one place, so both implementations reject the same inputs) and
// the gamma preparation.
#pragma once

#include <cstdint>
#include <vector>

#include "leanstep/rmsnorm.h"

namespace leanstep::rmsnorm::detail {

struct RowShape {
  int64_t rows = 0;    // product of the leading dims
  int64_t hidden = 0;  // H, the last dim
};

// `cpu_only`: the kernels' own check (host memory); false for the device
// backends' check on metadata (check_forward_args, check_backward_args).
RowShape check_forward(const char* where, const Tensor& x, const Tensor& gamma, const Tensor& y,
                       const Tensor& rstd, const Options& options, bool cpu_only = true);
RowShape check_backward(const char* where, const Tensor& dy, const Tensor& x, const Tensor& rstd,
                        const Tensor& gamma, const Tensor& dx, const Tensor* dgamma,
                        const Options& options, bool cpu_only = true);

// The effective weight in fp32: gamma, or 1 + gamma (computed in fp32).
std::vector<float> effective_gamma(const Tensor& gamma, bool zero_centered);

// Rows per chunk of the parallel loops: depends on H only (never on the thread
// count), so the trainable dgamma's chunk partials and their reduction tree are
// fixed for a given shape. About 256K elements per chunk, and at least 16 rows so
// that for very wide rows the fp32 partials (one H-row per chunk) stay a few
// percent of the activation traffic.
inline int64_t rows_per_chunk(int64_t hidden) {
  const int64_t target = int64_t{1} << 18;
  const int64_t rows = target / hidden;
  return rows < 16 ? 16 : rows;
}

}  // namespace leanstep::rmsnorm::detail
