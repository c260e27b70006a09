// Fused operations over a Plan: one parallel dispatch over the plan's fixed
// work chunks (plus one for generic views), partials combined in a fixed tree.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.h"
#include "grad/checks.h"
#include "grad/kernels.h"
#include "leanstep/grad.h"

namespace leanstep::grad {
using detail::NormKind;
using detail::Partial;

namespace {

// The whole fused pass. `scale` null: read-only. `skip_unit_scale`: a scale
// of exactly 1 is not applied (the unscale semantics); clip always multiplies.
Partial fused_pass(const PlanView& plan, NormKind kind, double p, const float* scale, bool skip_unit_scale) {
  const auto& chunks = plan.chunks();
  const auto& regions = plan.regions();
  const auto& generic = plan.generic();
  const size_t num_chunks = chunks.size();
  std::vector<Partial> partials(num_chunks + generic.size());
  auto scale_value = [&] { return scale ? *scale : 1.0f; };  // read inside the pass (backend memory)
  auto scaling = [&] { return scale != nullptr && !(skip_unit_scale && *scale == 1.0f); };

  // A generic view sharing memory with another view is scaled first, alone and
  // in list order (scaling commutes per element, so the result equals the
  // per-tensor loop); its norm is taken after all scaling, with the regions'.
  const bool generic_scaled_first = scale != nullptr && plan.generic_aliases();
  std::vector<Partial> pre(generic_scaled_first ? generic.size() : 0);
  for (size_t k = 0; k < pre.size(); ++k) {
    count_dispatch();
    detail::reduce_scale_view(generic[k].view, NormKind::kNone, p, scaling(), scale_value(), pre[k]);
  }

  leanstep::detail::parallel_items(static_cast<int64_t>(num_chunks), [&](int64_t i) {
    const WorkChunk& c = chunks[static_cast<size_t>(i)];
    const Region& r = regions[static_cast<size_t>(c.region)];
    char* data = static_cast<char*>(r.data) + c.begin * static_cast<int64_t>(dtype_size(r.dtype));
    detail::reduce_scale_run(data, r.dtype, c.end - c.begin, r.multiplicity, kind, p, scaling(), scale_value(),
                             partials[static_cast<size_t>(i)]);
  });
  if (!generic.empty()) {
    leanstep::detail::parallel_items(static_cast<int64_t>(generic.size()), [&](int64_t k) {
      Partial& out = partials[num_chunks + static_cast<size_t>(k)];
      detail::reduce_scale_view(generic[static_cast<size_t>(k)].view, kind, p,
                                scaling() && !generic_scaled_first, scale_value(), out);
      if (generic_scaled_first) out.nonfinite = pre[static_cast<size_t>(k)].nonfinite;
    });
  }
  return leanstep::detail::tree_reduce(partials.data(), static_cast<int64_t>(partials.size()), Partial{}, detail::combine);
}

}  // namespace

namespace detail {

// Turns a (local) partial into the norm and flag, reducing across ranks.
void finish_norm(const Partial& local, NormKind kind, double p, const Tensor& out_norm, const Tensor* found_inf,
                 comm::Communicator* comm) {
  double stats[2] = {
      kind == NormKind::kInf ? (local.nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(local.max))
                             : local.sum,
      local.nonfinite ? 1.0 : 0.0};
  if (comm) comm->allreduce(Tensor(stats, DType::kFloat64, {2}), kind == NormKind::kInf ? comm::ReduceOp::kMax
                                                                                         : comm::ReduceOp::kSum);
  double norm = stats[0];
  if (kind == NormKind::kL2) norm = std::sqrt(stats[0]);
  else if (kind == NormKind::kGeneral) norm = std::pow(stats[0], 1.0 / p);
  *out_norm.data_as<float>() = static_cast<float>(norm);
  if (found_inf && stats[1] > 0) *found_inf->data_as<float>() = 1.0f;
}

float clip_coefficient(float total_norm, double max_norm) {
  // As Megatron: fp32 max_norm / (norm + 1e-6), clamped to at most 1 on the
  // backend. A NaN norm gives a NaN coefficient (the grads become NaN, never
  // silently unclipped).
  const float c = static_cast<float>(max_norm) / (total_norm + 1.0e-6f);
  if (std::isnan(c)) return c;
  return c < 1.0f ? c : 1.0f;
}

}  // namespace detail

void norm(const PlanView& plan, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
          comm::Communicator* comm) {
  static constexpr const char* kWhere = "grad::norm";
  detail::check_norm_type(norm_type, kWhere);
  detail::check_scalar(out_norm, DType::kFloat32, kWhere, "out_norm");
  if (found_inf) detail::check_scalar(*found_inf, DType::kFloat32, kWhere, "found_inf");
  const NormKind kind = detail::norm_kind(norm_type);
  detail::finish_norm(fused_pass(plan, kind, norm_type, nullptr, false), kind, norm_type, out_norm, found_inf, comm);
}

void unscale_norm(const PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm, const Tensor& found_inf,
                  double norm_type, comm::Communicator* comm) {
  static constexpr const char* kWhere = "grad::unscale_norm";
  check_in_place(plan, kWhere);
  detail::check_norm_type(norm_type, kWhere);
  detail::check_scalar(inv_scale, DType::kFloat32, kWhere, "inv_scale");
  detail::check_scalar(out_norm, DType::kFloat32, kWhere, "out_norm");
  detail::check_scalar(found_inf, DType::kFloat32, kWhere, "found_inf");
  const NormKind kind = detail::norm_kind(norm_type);
  detail::finish_norm(fused_pass(plan, kind, norm_type, inv_scale.data_as<const float>(), true), kind, norm_type,
                      out_norm, &found_inf, comm);
}

void unscale_norm(const PlanView& plan, float inv_scale, const Tensor& out_norm, const Tensor& found_inf,
                  double norm_type, comm::Communicator* comm) {
  float scale_storage = inv_scale;
  unscale_norm(plan, Tensor(&scale_storage, DType::kFloat32, {1}), out_norm, found_inf, norm_type, comm);
}

void clip(const PlanView& plan, const Tensor& total_norm, double max_norm, const Tensor* out_coeff) {
  static constexpr const char* kWhere = "grad::clip";
  check_in_place(plan, kWhere);
  detail::check_max_norm(max_norm, kWhere);
  detail::check_scalar(total_norm, DType::kFloat32, kWhere, "total_norm");
  if (out_coeff) detail::check_scalar(*out_coeff, DType::kFloat32, kWhere, "out_coeff");
  // The coefficient is computed from backend memory by the backend (on CPU the
  // calling thread plays the device); the host never decides on it.
  float coeff_storage = detail::clip_coefficient(*total_norm.data_as<const float>(), max_norm);
  float* coeff = out_coeff ? out_coeff->data_as<float>() : &coeff_storage;
  *coeff = coeff_storage;
  fused_pass(plan, NormKind::kNone, 2.0, coeff, false);
}

void norm_clip(const PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
               const Tensor* out_coeff, comm::Communicator* comm) {
  check_in_place(plan, "grad::norm_clip");
  detail::check_max_norm(max_norm, "grad::norm_clip");
  norm(plan, out_norm, norm_type, found_inf, comm);
  clip(plan, out_norm, max_norm, out_coeff);
}

void scale(const PlanView& plan, const Tensor& scale) {
  check_in_place(plan, "grad::scale");
  detail::check_scalar(scale, DType::kFloat32, "grad::scale", "scale");
  fused_pass(plan, NormKind::kNone, 2.0, scale.data_as<const float>(), false);
}

void float_path_norm(const Tensor& total, double exponent, const Tensor& out_norm) {
  static constexpr const char* kWhere = "grad::float_path_norm";
  detail::check_scalar(total, DType::kFloat32, kWhere, "total");
  detail::check_scalar(out_norm, DType::kFloat64, kWhere, "out_norm");
  LEANSTEP_CHECK_ARG(std::isfinite(exponent) && exponent > 0, kWhere, "exponent",
                     fmt::format("must be finite and > 0, 1 / norm_type (got {})", exponent));
  // Python's float ** for a base >= 0 (or NaN, inf) and a finite exponent > 0 is
  // the C library's pow; a fp32 total widens to double exactly.
  *out_norm.data_as<double>() = std::pow(static_cast<double>(*total.data_as<const float>()), exponent);
}

float float_path_clip_coefficient(double total_norm, double max_norm) {
  const double coeff = max_norm / (total_norm + 1.0e-6);
  return coeff < 1.0 ? static_cast<float>(coeff) : 1.0f;  // NaN compares false: 1
}

bool float_path_clip_coefficient(const Tensor& total_norm, double max_norm, const Tensor& out_coeff) {
  static constexpr const char* kWhere = "grad::float_path_clip_coefficient";
  detail::check_max_norm(max_norm, kWhere);
  detail::check_scalar(total_norm, DType::kFloat64, kWhere, "total_norm");
  detail::check_scalar(out_coeff, DType::kFloat32, kWhere, "out_coeff");
  const float coeff = float_path_clip_coefficient(*total_norm.data_as<const double>(), max_norm);
  *out_coeff.data_as<float>() = coeff;
  return coeff < 1.0f;
}

float torch_clip_coefficient(float total_norm, double max_norm) {
  const float shifted = total_norm + 1.0e-6f;  // torch: the scalar 1e-6 rounded to fp32, then one add
  const float reciprocal = 1.0f / shifted;
  const float coeff = reciprocal * static_cast<float>(max_norm);
  return std::isnan(coeff) ? coeff : std::min(coeff, 1.0f);
}

void torch_clip_coefficient(const Tensor& total_norm, double max_norm, const Tensor& out_coeff) {
  static constexpr const char* kWhere = "grad::torch_clip_coefficient";
  detail::check_max_norm(max_norm, kWhere);
  // fp32(max_norm) must be a value, never an out-of-range conversion.
  LEANSTEP_CHECK_ARG(max_norm <= static_cast<double>(std::numeric_limits<float>::max()), kWhere, "max_norm",
                     fmt::format("must be at most the largest fp32, {} (got {})",
                                 std::numeric_limits<float>::max(), max_norm));
  detail::check_scalar(total_norm, DType::kFloat32, kWhere, "total_norm");
  detail::check_scalar(out_coeff, DType::kFloat32, kWhere, "out_coeff");
  *out_coeff.data_as<float>() = torch_clip_coefficient(*total_norm.data_as<const float>(), max_norm);
}

void count_zeros(const PlanView& plan, const Tensor& out_count, comm::Communicator* comm) {
  detail::check_scalar(out_count, DType::kInt64, "grad::count_zeros", "out_count");
  const auto& chunks = plan.chunks();
  const auto& regions = plan.regions();
  const auto& generic = plan.generic();
  std::vector<int64_t> partials(chunks.size() + generic.size(), 0);
  leanstep::detail::parallel_items(static_cast<int64_t>(chunks.size()), [&](int64_t i) {
    const WorkChunk& c = chunks[static_cast<size_t>(i)];
    const Region& r = regions[static_cast<size_t>(c.region)];
    const char* data = static_cast<const char*>(r.data) + c.begin * static_cast<int64_t>(dtype_size(r.dtype));
    partials[static_cast<size_t>(i)] = r.multiplicity * detail::count_zeros_run(data, r.dtype, c.end - c.begin);
  });
  if (!generic.empty()) {
    leanstep::detail::parallel_items(static_cast<int64_t>(generic.size()), [&](int64_t k) {
      partials[chunks.size() + static_cast<size_t>(k)] = detail::count_zeros_view(generic[static_cast<size_t>(k)].view);
    });
  }
  int64_t total = 0;
  for (int64_t z : partials) total += z;  // integers: any order is exact
  if (comm) comm->allreduce(Tensor(&total, DType::kInt64, {1}), comm::ReduceOp::kSum);
  *out_count.data_as<int64_t>() = total;
}

}  // namespace leanstep::grad
