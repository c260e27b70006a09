// Per-tensor reference path (see reference.h). Deliberately plain: one
// element at a time, one dispatch and one host read per tensor.
#include "leanstep/grad.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "grad/checks.h"
#include "grad/kernels.h"

namespace leanstep::grad::reference {
using detail::NormKind;
using detail::Partial;

namespace {

constexpr int64_t kChunk = int64_t{1} << 16;

// Calls f(offset) for elements [begin, end) of the view in row-major order.
template <class F>
void for_each_offset(const Tensor& t, const std::vector<int64_t>& offsets, int64_t begin, int64_t end, F&& f) {
  if (t.is_contiguous()) {
    for (int64_t e = begin; e < end; ++e) f(e);
  } else {
    for (int64_t e = begin; e < end; ++e) f(offsets[static_cast<size_t>(e)]);
  }
}

std::vector<int64_t> offsets_if_strided(const Tensor& t) {
  return t.is_contiguous() ? std::vector<int64_t>{} : detail::element_offsets(t);
}

// The per-element work of one tensor chunk: check, optionally scale in place
// (fp32 multiply, one rounding to the dtype), accumulate the norm term.
template <class Get, class Put>
void element_loop(int64_t begin, int64_t end, Get get, Put put, DType dtype, NormKind kind, double p, bool do_scale,
                  float scale, Partial& out) {
  double sum = 0.0;
  float max = out.max;
  bool nan = false, nonfinite = false;
  for (int64_t e = begin; e < end; ++e) {
    double v = get(e);
    if (!std::isfinite(v)) nonfinite = true;
    if (do_scale) {
      v = detail::scale_round(v, dtype, scale);
      put(e, v);
    }
    if (kind == NormKind::kInf) {
      if (std::isnan(v)) nan = true;
      else max = std::max(max, static_cast<float>(std::fabs(v)));
    } else if (kind != NormKind::kNone) {
      sum += detail::power_term(v, kind, p);
    }
  }
  out.sum += sum;
  out.max = max;
  out.nan = out.nan || nan;
  out.nonfinite = out.nonfinite || nonfinite;
}

// One tensor's partial in one dispatch; optionally unscales first (in place).
Partial tensor_pass(const Tensor& t, NormKind kind, double p, bool do_scale, float scale) {
  const auto offsets = offsets_if_strided(t);
  const int64_t n = t.numel();
  std::vector<Partial> partials(static_cast<size_t>(leanstep::detail::num_chunks(n, kChunk)));
  leanstep::detail::parallel_chunks(n, kChunk, [&](int64_t c, int64_t begin, int64_t end) {
    Partial& out = partials[static_cast<size_t>(c)];
    if (t.is_contiguous() && t.dtype == DType::kFloat32) {  // plain typed loop for the common case
      float* x = t.data_as<float>();
      element_loop(begin, end, [x](int64_t e) { return static_cast<double>(x[e]); },
                   [x](int64_t e, double v) { x[e] = static_cast<float>(v); }, t.dtype, kind, p, do_scale, scale, out);
    } else {
      auto offset = [&](int64_t e) { return t.is_contiguous() ? e : offsets[static_cast<size_t>(e)]; };
      element_loop(begin, end, [&](int64_t e) { return load_as_double(t.data, t.dtype, offset(e)); },
                   [&](int64_t e, double v) { store_from_double(t.data, t.dtype, offset(e), v); }, t.dtype, kind, p,
                   do_scale, scale, out);
    }
  });
  return leanstep::detail::tree_reduce(partials.data(), static_cast<int64_t>(partials.size()), Partial{},
                                       detail::combine);
}

// The framework-style host read of one tensor's result.
double host_read(double value) {
  double storage = value;
  return read_scalar(Tensor(&storage, DType::kFloat64, {1}));
}

Partial norm_over(std::span<const Tensor> grads, NormKind kind, double p) {
  Partial total;
  for (const Tensor& t : grads) {
    if (t.empty()) continue;
    const Partial part = tensor_pass(t, kind, p, false, 1.0f);
    Partial read = part;
    read.sum = host_read(kind == NormKind::kInf ? (part.nan ? std::numeric_limits<double>::quiet_NaN() : part.max)
                                                : part.sum);
    if (kind == NormKind::kInf) {
      if (std::isnan(read.sum)) total.nan = true;
      else total.max = std::max(total.max, static_cast<float>(read.sum));
    } else {
      total.sum += read.sum;
    }
    total.nonfinite = total.nonfinite || part.nonfinite;
  }
  return total;
}

void check_grads(std::span<const Tensor> grads, const char* where) {
  for (size_t i = 0; i < grads.size(); ++i) detail::check_grad_view(grads[i], where, fmt::format("grads[{}]", i));
}

void check_grads_in_place(std::span<const Tensor> grads, const char* where) {
  check_grads(grads, where);
  for (size_t i = 0; i < grads.size(); ++i) check_no_self_overlap(grads[i], where, fmt::format("grads[{}]", i));
}

}  // namespace

void norm(std::span<const Tensor> grads, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
          comm::Communicator* comm) {
  static constexpr const char* kWhere = "grad::reference::norm";
  detail::check_norm_type(norm_type, kWhere);
  detail::check_scalar(out_norm, DType::kFloat32, kWhere, "out_norm");
  if (found_inf) detail::check_scalar(*found_inf, DType::kFloat32, kWhere, "found_inf");
  check_grads(grads, kWhere);
  const NormKind kind = detail::norm_kind(norm_type);
  detail::finish_norm(norm_over(grads, kind, norm_type), kind, norm_type, out_norm, found_inf, comm);
}

void unscale_norm(std::span<const Tensor> grads, const Tensor& inv_scale, const Tensor& out_norm,
                  const Tensor& found_inf, double norm_type, comm::Communicator* comm) {
  static constexpr const char* kWhere = "grad::reference::unscale_norm";
  detail::check_norm_type(norm_type, kWhere);
  detail::check_scalar(inv_scale, DType::kFloat32, kWhere, "inv_scale");
  detail::check_scalar(out_norm, DType::kFloat32, kWhere, "out_norm");
  detail::check_scalar(found_inf, DType::kFloat32, kWhere, "found_inf");
  check_grads_in_place(grads, kWhere);
  const float s = *inv_scale.data_as<const float>();
  bool nonfinite = false;
  for (const Tensor& t : grads)
    if (!t.empty()) nonfinite |= tensor_pass(t, NormKind::kNone, norm_type, s != 1.0f, s).nonfinite;
  const NormKind kind = detail::norm_kind(norm_type);
  Partial total = norm_over(grads, kind, norm_type);
  total.nonfinite = nonfinite;  // the flag describes the inputs of the unscale
  detail::finish_norm(total, kind, norm_type, out_norm, &found_inf, comm);
}

void clip(std::span<const Tensor> grads, const Tensor& total_norm, double max_norm, const Tensor* out_coeff) {
  static constexpr const char* kWhere = "grad::reference::clip";
  detail::check_max_norm(max_norm, kWhere);
  detail::check_scalar(total_norm, DType::kFloat32, kWhere, "total_norm");
  if (out_coeff) detail::check_scalar(*out_coeff, DType::kFloat32, kWhere, "out_coeff");
  check_grads_in_place(grads, kWhere);
  const float coeff = detail::clip_coefficient(static_cast<float>(read_scalar(total_norm)), max_norm);
  if (out_coeff) *out_coeff->data_as<float>() = coeff;
  for (const Tensor& t : grads)
    if (!t.empty()) tensor_pass(t, NormKind::kNone, 2.0, true, coeff);
}

void norm_clip(std::span<const Tensor> grads, double max_norm, const Tensor& out_norm, double norm_type,
               const Tensor* found_inf, const Tensor* out_coeff, comm::Communicator* comm) {
  detail::check_max_norm(max_norm, "grad::reference::norm_clip");
  check_grads_in_place(grads, "grad::reference::norm_clip");
  norm(grads, out_norm, norm_type, found_inf, comm);
  clip(grads, out_norm, max_norm, out_coeff);
}

void count_zeros(std::span<const Tensor> grads, const Tensor& out_count, comm::Communicator* comm) {
  detail::check_scalar(out_count, DType::kInt64, "grad::reference::count_zeros", "out_count");
  check_grads(grads, "grad::reference::count_zeros");
  int64_t total = 0;
  for (const Tensor& t : grads) {
    count_dispatch();
    total += detail::count_zeros_view(t);
  }
  if (comm) comm->allreduce(Tensor(&total, DType::kInt64, {1}), comm::ReduceOp::kSum);
  *out_count.data_as<int64_t>() = total;
}

void scale(std::span<const Tensor> grads, float scale) {
  check_grads_in_place(grads, "grad::reference::scale");
  for (const Tensor& t : grads)
    if (!t.empty()) tensor_pass(t, NormKind::kNone, 2.0, true, scale);
}

void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, float scale,
                        const Tensor& found_inf) {
  static constexpr const char* kWhere = "grad::reference::multi_tensor_scale";
  LEANSTEP_CHECK_ARG(in.size() == out.size(), kWhere, "out",
                     fmt::format("must have as many tensors as 'in' ({}) (got {})", in.size(), out.size()));
  detail::check_scalar(found_inf, DType::kFloat32, kWhere, "found_inf");
  for (size_t i = 0; i < in.size(); ++i) {
    detail::check_grad_view(in[i], kWhere, fmt::format("in[{}]", i));
    detail::check_grad_view(out[i], kWhere, fmt::format("out[{}]", i));
    check_no_self_overlap(out[i], kWhere, fmt::format("out[{}]", i));
    LEANSTEP_CHECK_ARG(in[i].numel() == out[i].numel(), kWhere, fmt::format("out[{}]", i), "must match in's numel");
  }
  for (size_t i = 0; i < in.size(); ++i) {
    count_dispatch();
    const auto in_off = offsets_if_strided(in[i]);
    const auto out_off = offsets_if_strided(out[i]);
    std::vector<float> values(static_cast<size_t>(in[i].numel()));
    for_each_offset(in[i], in_off, 0, in[i].numel(), [&, e = int64_t{0}](int64_t off) mutable {
      const float v = static_cast<float>(load_as_double(in[i].data, in[i].dtype, off));
      if (!std::isfinite(v)) *found_inf.data_as<float>() = 1.0f;
      values[static_cast<size_t>(e++)] = v * scale;
    });
    for_each_offset(out[i], out_off, 0, out[i].numel(), [&, e = int64_t{0}](int64_t off) mutable {
      store_from_double(out[i].data, out[i].dtype, off, values[static_cast<size_t>(e++)]);
    });
  }
}

}  // namespace leanstep::grad::reference
