// The per-tensor reference path: one reduction (one dispatch) per tensor, as
// the frameworks' multi-tensor fallbacks do. It is the semantics oracle of the
// fused path and the benchmark baseline. Like those fallbacks it reads each
// tensor's partial back to the host (counted with count_host_read), but it
// keeps the partials in double (it does not round each tensor's norm).
#pragma once

#include <span>

#include "leanstep/comm.h"
#include "leanstep/core.h"

namespace leanstep::grad::reference {

void norm(std::span<const Tensor> grads, const Tensor& out_norm, double norm_type = 2.0,
          const Tensor* found_inf = nullptr, comm::Communicator* comm = nullptr);
// For each tensor in order: unscale in place + check; then the norm of all.
void unscale_norm(std::span<const Tensor> grads, const Tensor& inv_scale, const Tensor& out_norm,
                  const Tensor& found_inf, double norm_type = 2.0, comm::Communicator* comm = nullptr);
// Reads the norm on the host (one host read), then scales tensor by tensor.
void clip(std::span<const Tensor> grads, const Tensor& total_norm, double max_norm, const Tensor* out_coeff = nullptr);
void norm_clip(std::span<const Tensor> grads, double max_norm, const Tensor& out_norm, double norm_type = 2.0,
               const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr, comm::Communicator* comm = nullptr);
void count_zeros(std::span<const Tensor> grads, const Tensor& out_count, comm::Communicator* comm = nullptr);
// Pairs in list order; each pair reads its whole input (into a temporary) before writing.
void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, float scale, const Tensor& found_inf);

}  // namespace leanstep::grad::reference
