// RMSNorm: forward/backward kernels (fused and reference), the routed entry
// points with their feature-delegation decision, and path statistics.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <leanstep/ops.h>
#include <leanstep/rmsnorm.h>

#include "arrays.h"
#include "bindings.h"

namespace leanstep::py {
namespace {

rmsnorm::Options make_options(double eps, bool zero_centered_gamma, const std::string& rounding) {
  rmsnorm::Options options;
  options.eps = eps;
  options.zero_centered_gamma = zero_centered_gamma;
  options.rounding = rmsnorm::rounding_from_name(rounding);
  return options;
}

rmsnorm::SumOrder sum_order_from_name(const std::string& name) {
  if (name == "lanes") return rmsnorm::SumOrder::kLanes;
  if (name == "torch_cpu") return rmsnorm::SumOrder::kTorchCpu;
  throw_arg_error("rms_norm", "sum_order", "must be 'lanes' or 'torch_cpu' (got '" + name + "')");
}

bool use_reference(const std::string& impl) {
  if (impl == "fused") return false;
  if (impl == "reference") return true;
  throw_arg_error("rms_norm", "impl", "must be 'fused' or 'reference' (got '" + impl + "')");
}

nb::dict decision_dict(const rmsnorm::Decision& d) {
  nb::dict out;
  out["path"] = rmsnorm::path_name(d.path);
  out["reason"] = rmsnorm::reason_name(d.reason);
  out["explain"] = d.explain();
  return out;
}

rmsnorm::CallContext make_context(bool weight_requires_grad, bool fp8_output, bool autocast,
                                  bool activation_offload, bool debug_hooks,
                                  bool compiled_or_captured, bool user_subclass) {
  rmsnorm::CallContext c;
  c.weight_requires_grad = weight_requires_grad;
  c.fp8_output = fp8_output;
  c.autocast = autocast;
  c.activation_offload = activation_offload;
  c.debug_hooks = debug_hooks;
  c.compiled_or_captured = compiled_or_captured;
  c.user_subclass = user_subclass;
  return c;
}

void check_rounding(const std::string& rounding, const char* where) {
  if (rounding != "scale_then_cast" && rounding != "cast_then_scale")
    throw_arg_error(where, "rounding", "must be scale_then_cast or cast_then_scale (got '" + rounding + "')");
}

}  // namespace

void bind_rmsnorm(nb::module_& m) {
  m.def(
      "rmsnorm_check_forward",
      [](const nb::tuple& x, const nb::tuple& weight, const nb::tuple& y, const nb::tuple& rstd, double eps,
         bool zero_centered_gamma, const std::string& rounding) {
        check_rounding(rounding, "rms_norm");
        rmsnorm::check_forward_args(meta_tensor(x, "rms_norm", "x"), meta_tensor(weight, "rms_norm", "weight"),
                                    meta_tensor(y, "rms_norm", "y"), meta_tensor(rstd, "rms_norm", "rstd"),
                                    make_options(eps, zero_centered_gamma, rounding));
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("rstd"), nb::arg("eps"),
      nb::arg("zero_centered_gamma"), nb::arg("rounding"),
      "The forward's argument rules on metadata ((address, dtype, shape, strides) each), for "
      "the device backends.");
  m.def(
      "rmsnorm_check_backward",
      [](const nb::tuple& dy, const nb::tuple& x, const nb::tuple& rstd, const nb::tuple& weight,
         const nb::tuple& dx, std::optional<nb::tuple> dweight) {
        const char* w = "rms_norm_backward";
        const std::optional<Tensor> dw =
            dweight ? std::optional<Tensor>(meta_tensor(*dweight, w, "dweight")) : std::nullopt;
        rmsnorm::check_backward_args(meta_tensor(dy, w, "dy"), meta_tensor(x, w, "x"), meta_tensor(rstd, w, "rstd"),
                                     meta_tensor(weight, w, "weight"), meta_tensor(dx, w, "dx"),
                                     dw ? &*dw : nullptr);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("rstd"), nb::arg("weight"), nb::arg("dx"),
      nb::arg("dweight").none(),
      "The backward's argument rules on metadata, for the device backends.");

  m.def(
      "rmsnorm_forward",
      [](InArray x, InArray gamma, OutArray y, OutArray rstd, double eps, bool zero_centered_gamma,
         const std::string& rounding, const std::string& impl, const std::string& sum_order) {
        const Tensor xt = to_tensor(x, "x"), gt = to_tensor(gamma, "weight");
        const Tensor yt = to_tensor(y, "y"), rt = to_tensor(rstd, "rstd");
        rmsnorm::Options options = make_options(eps, zero_centered_gamma, rounding);
        options.sum_order = sum_order_from_name(sum_order);
        const bool reference = use_reference(impl);
        nb::gil_scoped_release release;
        if (reference) rmsnorm::forward_reference(xt, gt, yt, rt, options);
        else rmsnorm::forward_fused(xt, gt, yt, rt, options);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("rstd"), nb::arg("eps"),
      nb::arg("zero_centered_gamma") = false, nb::arg("rounding") = "scale_then_cast",
      nb::arg("impl") = "fused", nb::arg("sum_order") = "lanes",
      "sum_order: 'lanes' (leanstep's) or 'torch_cpu' (torch's composite rms_norm on the CPU, "
      "bit for bit with its torch convention).");

  m.def(
      "rmsnorm_backward",
      [](InArray dy, InArray x, InArray rstd, InArray gamma, OutArray dx,
         std::optional<OutArray> dgamma, double eps, bool zero_centered_gamma,
         const std::string& impl) {
        const Tensor dyt = to_tensor(dy, "dy"), xt = to_tensor(x, "x");
        const Tensor rt = to_tensor(rstd, "rstd"), gt = to_tensor(gamma, "weight");
        const Tensor dxt = to_tensor(dx, "dx");
        const std::optional<Tensor> dgt = to_tensor(dgamma, "dweight");
        const rmsnorm::Options options = make_options(eps, zero_centered_gamma, "scale_then_cast");
        const bool reference = use_reference(impl);
        nb::gil_scoped_release release;
        const Tensor* dg = dgt ? &*dgt : nullptr;
        if (reference) rmsnorm::backward_reference(dyt, xt, rt, gt, dxt, dg, options);
        else rmsnorm::backward_fused(dyt, xt, rt, gt, dxt, dg, options);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("rstd"), nb::arg("weight"), nb::arg("dx"),
      nb::arg("dweight").none(), nb::arg("eps"), nb::arg("zero_centered_gamma") = false,
      nb::arg("impl") = "fused");

  // Routed entry points: through the dispatch registry, the decision returned as a dict.
  m.def(
      "rmsnorm_forward_routed",
      [](InArray x, InArray gamma, OutArray y, OutArray rstd, double eps, bool zero_centered_gamma,
         const std::string& rounding, bool weight_requires_grad, bool fp8_output, bool autocast,
         bool activation_offload, bool debug_hooks, bool compiled_or_captured, bool user_subclass) {
        const Tensor xt = to_tensor(x, "x"), gt = to_tensor(gamma, "weight");
        const Tensor yt = to_tensor(y, "y"), rt = to_tensor(rstd, "rstd");
        const rmsnorm::Options options = make_options(eps, zero_centered_gamma, rounding);
        const rmsnorm::CallContext context =
            make_context(weight_requires_grad, fp8_output, autocast, activation_offload,
                         debug_hooks, compiled_or_captured, user_subclass);
        // Through the registry: the preset, the guards (rmsnorm::decide) and
        // the `leanstep paths` counts apply to Python callers as to C++ ones.
        {
          nb::gil_scoped_release release;
          ops::rmsnorm_forward(xt, gt, yt, rt, options, context);
        }
        return decision_dict(rmsnorm::decide(context));
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("rstd"), nb::arg("eps"),
      nb::arg("zero_centered_gamma") = false, nb::arg("rounding") = "scale_then_cast",
      nb::kw_only(), nb::arg("weight_requires_grad") = true, nb::arg("fp8_output") = false,
      nb::arg("autocast") = false, nb::arg("activation_offload") = false,
      nb::arg("debug_hooks") = false, nb::arg("compiled_or_captured") = false,
      nb::arg("user_subclass") = false);

  m.def(
      "rmsnorm_backward_routed",
      [](InArray dy, InArray x, InArray rstd, InArray gamma, OutArray dx,
         std::optional<OutArray> dgamma, double eps, bool zero_centered_gamma,
         bool weight_requires_grad, bool fp8_output, bool autocast, bool activation_offload,
         bool debug_hooks, bool compiled_or_captured, bool user_subclass) {
        const Tensor dyt = to_tensor(dy, "dy"), xt = to_tensor(x, "x");
        const Tensor rt = to_tensor(rstd, "rstd"), gt = to_tensor(gamma, "weight");
        const Tensor dxt = to_tensor(dx, "dx");
        const std::optional<Tensor> dgt = to_tensor(dgamma, "dweight");
        const rmsnorm::Options options = make_options(eps, zero_centered_gamma, "scale_then_cast");
        const rmsnorm::CallContext context =
            make_context(weight_requires_grad, fp8_output, autocast, activation_offload,
                         debug_hooks, compiled_or_captured, user_subclass);
        {
          nb::gil_scoped_release release;
          ops::rmsnorm_backward(dyt, xt, rt, gt, dxt, dgt ? &*dgt : nullptr, options, context);
        }
        return decision_dict(rmsnorm::decide(context));
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("rstd"), nb::arg("weight"), nb::arg("dx"),
      nb::arg("dweight").none(), nb::arg("eps"), nb::arg("zero_centered_gamma") = false,
      nb::kw_only(), nb::arg("weight_requires_grad") = true, nb::arg("fp8_output") = false,
      nb::arg("autocast") = false, nb::arg("activation_offload") = false,
      nb::arg("debug_hooks") = false, nb::arg("compiled_or_captured") = false,
      nb::arg("user_subclass") = false);

  // The lean entry points of leanstep.torch's RMSNorm (its decision made and
  // cached in Python): tensors taken through DLPack's exchange table, positional
  // arguments, nothing returned. Through the registry as the routed ones, with
  // no feature set (the caller checked them).
  m.def(
      "rmsnorm_forward_lean",
      [](const InArray& x, const InArray& gamma, const OutArray& y, const std::optional<OutArray>& rstd,
         double eps, bool zero_centered_gamma, bool cast_then_scale, bool weight_requires_grad,
         bool torch_order) {
        const Tensor xt = to_tensor(x, "x"), gt = to_tensor(gamma, "weight");
        const Tensor yt = to_tensor(y, "y");
        // rstd=None (a forward nothing differentiates): the kernel's rstd goes to a
        // per-thread scratch row, not to a tensor the caller allocates and drops.
        thread_local std::vector<float> rstd_scratch;
        Tensor rt;
        if (rstd) {
          rt = to_tensor(*rstd, "rstd");
        } else {
          const int64_t width = xt.ndim > 0 ? xt.shape[xt.ndim - 1] : 0;
          const int64_t rows = width > 0 ? xt.numel() / width : 0;
          if (rstd_scratch.size() < static_cast<size_t>(rows)) rstd_scratch.resize(static_cast<size_t>(rows));
          rt = Tensor(rstd_scratch.data(), DType::kFloat32, {rows});
        }
        rmsnorm::Options options;
        options.eps = eps;
        options.zero_centered_gamma = zero_centered_gamma;
        options.rounding = cast_then_scale ? rmsnorm::RoundingOrder::kCastThenScale
                                           : rmsnorm::RoundingOrder::kScaleThenCast;
        options.sum_order = torch_order ? rmsnorm::SumOrder::kTorchCpu : rmsnorm::SumOrder::kLanes;
        rmsnorm::CallContext context;
        context.weight_requires_grad = weight_requires_grad;
        nb::gil_scoped_release release;
        ops::rmsnorm_forward(xt, gt, yt, rt, options, context);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("rstd").none(), nb::arg("eps"),
      nb::arg("zero_centered_gamma"), nb::arg("cast_then_scale"),
      nb::arg("weight_requires_grad"), nb::arg("torch_order") = false);
  m.def(
      "rmsnorm_backward_lean",
      [](const InArray& dy, const InArray& x, const InArray& rstd, const InArray& gamma,
         const OutArray& dx, const std::optional<OutArray>& dgamma, bool zero_centered_gamma) {
        const Tensor dyt = to_tensor(dy, "dy"), xt = to_tensor(x, "x");
        const Tensor rt = to_tensor(rstd, "rstd"), gt = to_tensor(gamma, "weight");
        const Tensor dxt = to_tensor(dx, "dx");
        const std::optional<Tensor> dgt = to_tensor(dgamma, "dweight");
        rmsnorm::Options options;
        options.eps = 0.0;  // eps enters through rstd, which the forward saved
        options.zero_centered_gamma = zero_centered_gamma;
        rmsnorm::CallContext context;
        context.weight_requires_grad = dgt.has_value();
        nb::gil_scoped_release release;
        ops::rmsnorm_backward(dyt, xt, rt, gt, dxt, dgt ? &*dgt : nullptr, options, context);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("rstd"), nb::arg("weight"), nb::arg("dx"),
      nb::arg("dweight").none(), nb::arg("zero_centered_gamma"));

  m.def(
      "rmsnorm_decide",
      [](bool weight_requires_grad, bool fp8_output, bool autocast, bool activation_offload,
         bool debug_hooks, bool compiled_or_captured, bool user_subclass) {
        return decision_dict(rmsnorm::decide(
            make_context(weight_requires_grad, fp8_output, autocast, activation_offload,
                         debug_hooks, compiled_or_captured, user_subclass)));
      },
      nb::kw_only(), nb::arg("weight_requires_grad") = true, nb::arg("fp8_output") = false,
      nb::arg("autocast") = false, nb::arg("activation_offload") = false,
      nb::arg("debug_hooks") = false, nb::arg("compiled_or_captured") = false,
      nb::arg("user_subclass") = false);

}

}  // namespace leanstep::py
