// The gradient engine (Plan, norm / unscale / clip / count_zeros,
// multi_tensor_scale) and the Megatron-Core DDP buffer layout builder. The
// operations call through the dispatch registry (leanstep/ops.h), so the
// preset and the `leanstep paths` report cover Python callers too.
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <leanstep/grad.h>
#include <leanstep/layout.h>
#include <leanstep/ops.h>

#include "arrays.h"
#include "exchange.h"
#include "bindings.h"
#include "fixtures/model_layouts.h"

namespace leanstep::py {
namespace {

const Tensor* ptr(const std::optional<Tensor>& t) { return t ? &*t : nullptr; }

nb::dict layout_dict(const layout::BufferLayout& b) {
  nb::dict d;
  d["grad_dtype"] = dtype_name(b.grad_dtype);
  d["param_dtype"] = dtype_name(b.param_dtype);
  d["is_expert"] = b.is_expert;
  d["numel"] = b.numel;
  d["numel_unpadded"] = b.numel_unpadded;
  nb::list params;
  for (const layout::ParamSlot& p : b.params) {
    nb::dict s;
    s["name"] = p.name;
    s["shape"] = nb::tuple(nb::cast(p.shape));
    s["param_index"] = p.param_index;
    s["offset"] = p.offset;
    s["numel"] = p.numel;
    s["bucket"] = p.bucket;
    params.append(s);
  }
  d["params"] = params;
  nb::list buckets;
  for (const layout::BucketRange& r : b.buckets)
    buckets.append(nb::make_tuple(r.begin, r.end, r.numel_unpadded));
  d["buckets"] = buckets;
  d["summary"] = b.summary();
  return d;
}

// A clip by a norm in backend memory under one coefficient rule: the coefficient
// computed from that memory (on the CPU the calling thread plays the device), the grads
// scaled by it through the grad.scale op where the rule says they are; returns that.
template <class Rule>
bool clip_by_rule(const grad::Plan& p, const InArray& total_norm, double max_norm, Rule rule) {
  const Tensor nt = to_tensor(total_norm, "total_norm");
  float coeff = 1.0f;
  const Tensor ct(&coeff, DType::kFloat32, {1});
  nb::gil_scoped_release release;
  const bool scales = rule(nt, max_norm, ct);
  if (scales) ops::grad_scale(p, ct);
  return scales;
}

}  // namespace

void bind_grad(nb::module_& m) {
  nb::class_<grad::Plan>(m, "GradPlanCore",
                         "The C++ plan. It holds raw pointers only: leanstep.GradPlan keeps the "
                         "grad arrays alive alongside it.")
      .def(
          "__init__",
          [](grad::Plan* self, const std::vector<OutArray>& grads,
             const std::vector<InArray>& declared_buffers) {
            const std::vector<Tensor> views = to_tensors(grads, "grads");
            const std::vector<Tensor> buffers = to_tensors(declared_buffers, "buffers");
            nb::gil_scoped_release release;
            new (self) grad::Plan(views, buffers);
          },
          nb::arg("grads"), nb::arg("buffers") = std::vector<InArray>{})
      .def_static(
          "from_key",
          // The plan of the list a key describes (tensor_list_key's bytes, or the key
          // grads_and_key gave with them), read from the key alone: the list's tensors
          // are not described a second time. The caller keeps them alive, as for
          // __init__, and passes the key of exactly those tensors.
          [](nb::bytes key) {
            const std::vector<Tensor> views =
                tensors_from_key(std::string_view(static_cast<const char*>(key.data()), key.size()));
            nb::gil_scoped_release release;
            return grad::Plan(views);
          },
          nb::arg("key"))
      .def_static(
          "from_layout",
          [](const std::vector<std::tuple<uintptr_t, std::string, std::vector<int64_t>,
                                          std::vector<int64_t>>>& views) {
            // The planner reads addresses, dtypes, shapes and strides only,
            // never the memory: device tensors (or synthetic per-storage
            // addresses, as the device backends pass) plan exactly as CPU ones.
            std::vector<Tensor> tensors;
            tensors.reserve(views.size());
            for (size_t i = 0; i < views.size(); ++i) {
              const auto& [address, dtype, shape, strides] = views[i];
              const std::string arg = "views[" + std::to_string(i) + "]";
              if (shape.size() != strides.size() || shape.size() > static_cast<size_t>(kMaxDims))
                throw Error("grad::Plan.from_layout: argument '" + arg +
                            "' must have as many strides as sizes, at most " +
                            std::to_string(kMaxDims) + " dims (got " +
                            std::to_string(shape.size()) + " sizes, " +
                            std::to_string(strides.size()) + " strides)");
              Tensor t;
              t.data = reinterpret_cast<void*>(address);
              t.dtype = dtype_from_name(dtype);
              t.ndim = static_cast<int>(shape.size());
              for (size_t d = 0; d < shape.size(); ++d) {
                t.shape[d] = shape[d];
                t.strides[d] = strides[d];
              }
              tensors.push_back(t);
            }
            nb::gil_scoped_release release;
            return grad::Plan(tensors);
          },
          nb::arg("views"),
          "A plan from (address, dtype, shape, strides) of each view, for memory the host "
          "does not read (device tensors). Only the region and generic tables are used.")
      .def_prop_ro("num_tensors", &grad::Plan::num_tensors)
      .def_prop_ro("num_regions", &grad::Plan::num_regions)
      .def_prop_ro("num_generic", &grad::Plan::num_generic)
      .def_prop_ro("num_empty", &grad::Plan::num_empty)
      .def_prop_ro("listed_bytes", &grad::Plan::listed_bytes)
      .def_prop_ro("touched_bytes", &grad::Plan::touched_bytes)
      .def_prop_ro("generic_aliases", &grad::Plan::generic_aliases)
      .def_prop_ro("first_self_overlapping", &grad::Plan::first_self_overlapping,
                   "Index of the first listed view that may overlap itself (in-place ops "
                   "refuse the plan), or -1.")
      .def("summary", &grad::Plan::summary)
      .def_prop_ro("regions",
                   [](const grad::Plan& p) {
                     nb::list out;
                     for (const grad::Region& r : p.regions())
                       out.append(nb::make_tuple(reinterpret_cast<uintptr_t>(r.data),
                                                 dtype_name(r.dtype), r.numel, r.multiplicity));
                     return out;
                   },
                   "(address, dtype, numel, multiplicity) of each coalesced region.")
      .def_prop_ro("generic",
                   [](const grad::Plan& p) {
                     nb::list out;
                     for (const grad::GenericView& g : p.generic())
                       out.append(nb::make_tuple(g.index, g.reason));
                     return out;
                   },
                   "(list index, reason) of each view that could not join a region.")
      .def(
          "norm",
          [](const grad::Plan& p, OutArray out_norm, double norm_type,
             std::optional<OutArray> found_inf) {
            const Tensor nt = to_tensor(out_norm, "out_norm");
            const std::optional<Tensor> ft = to_tensor(found_inf, "found_inf");
            nb::gil_scoped_release release;
            ops::grad_norm(p, nt, norm_type, ptr(ft));
          },
          nb::arg("out_norm"), nb::arg("norm_type") = 2.0,
          nb::arg("found_inf").none() = nb::none())
      .def(
          "unscale_norm",
          [](const grad::Plan& p, InArray inv_scale, OutArray out_norm, OutArray found_inf,
             double norm_type) {
            const Tensor st = to_tensor(inv_scale, "inv_scale");
            const Tensor nt = to_tensor(out_norm, "out_norm");
            const Tensor ft = to_tensor(found_inf, "found_inf");
            nb::gil_scoped_release release;
            ops::grad_unscale_norm(p, st, nt, ft, norm_type);
          },
          nb::arg("inv_scale"), nb::arg("out_norm"), nb::arg("found_inf"),
          nb::arg("norm_type") = 2.0)
      .def(
          "unscale_norm",
          [](const grad::Plan& p, float inv_scale, OutArray out_norm, OutArray found_inf,
             double norm_type) {
            const Tensor nt = to_tensor(out_norm, "out_norm");
            const Tensor ft = to_tensor(found_inf, "found_inf");
            nb::gil_scoped_release release;
            float scale_storage = inv_scale;  // the op takes the scale as backend memory
            ops::grad_unscale_norm(p, Tensor(&scale_storage, DType::kFloat32, {1}), nt, ft,
                                   norm_type);
          },
          nb::arg("inv_scale"), nb::arg("out_norm"), nb::arg("found_inf"),
          nb::arg("norm_type") = 2.0)
      .def(
          "unscale",
          [](const grad::Plan& p, InArray inv_scale, OutArray found_inf) {
            const Tensor st = to_tensor(inv_scale, "inv_scale");
            const Tensor ft = to_tensor(found_inf, "found_inf");
            nb::gil_scoped_release release;
            ops::grad_unscale(p, st, ft);
          },
          nb::arg("inv_scale"), nb::arg("found_inf"))
      .def(
          "unscale",
          [](const grad::Plan& p, float inv_scale, OutArray found_inf) {
            const Tensor ft = to_tensor(found_inf, "found_inf");
            nb::gil_scoped_release release;
            float scale_storage = inv_scale;  // the op takes the scale as backend memory
            ops::grad_unscale(p, Tensor(&scale_storage, DType::kFloat32, {1}), ft);
          },
          nb::arg("inv_scale"), nb::arg("found_inf"))
      .def(
          "clip",
          [](const grad::Plan& p, InArray total_norm, double max_norm,
             std::optional<OutArray> out_coeff) {
            const Tensor nt = to_tensor(total_norm, "norm");
            const std::optional<Tensor> ct = to_tensor(out_coeff, "out_coeff");
            nb::gil_scoped_release release;
            ops::grad_clip(p, nt, max_norm, ptr(ct));
          },
          nb::arg("total_norm"), nb::arg("max_norm"), nb::arg("out_coeff").none() = nb::none())
      .def(
          "norm_clip",
          [](const grad::Plan& p, double max_norm, OutArray out_norm, double norm_type,
             std::optional<OutArray> found_inf, std::optional<OutArray> out_coeff) {
            const Tensor nt = to_tensor(out_norm, "out_norm");
            const std::optional<Tensor> ft = to_tensor(found_inf, "found_inf");
            const std::optional<Tensor> ct = to_tensor(out_coeff, "out_coeff");
            nb::gil_scoped_release release;
            ops::grad_norm_clip(p, max_norm, nt, norm_type, ptr(ft), ptr(ct));
          },
          nb::arg("max_norm"), nb::arg("out_norm"), nb::arg("norm_type") = 2.0,
          nb::arg("found_inf").none() = nb::none(), nb::arg("out_coeff").none() = nb::none())
      .def(
          "scale",
          [](const grad::Plan& p, InArray scale) {
            const Tensor st = to_tensor(scale, "scale");
            nb::gil_scoped_release release;
            ops::grad_scale(p, st);
          },
          nb::arg("scale"))
      .def(
          "scale_by",
          // A host number: rounded to fp32 here as a 1-element fp32 array would hold it,
          // with no array made for it (no framework call on the host path).
          [](const grad::Plan& p, double scale) {
            float value = static_cast<float>(scale);
            const Tensor st(&value, DType::kFloat32, {1});
            nb::gil_scoped_release release;
            ops::grad_scale(p, st);
          },
          nb::arg("scale"))
      .def(
          "float_path_clip",
          // Megatron's float-path clip with its norm in backend memory: the coefficient
          // from that memory (grad::float_path_clip_coefficient), the grads scaled through
          // the grad.scale op where it is below 1 (the float path scales nothing otherwise).
          // Returns whether they were scaled (the caller counts a grad.scale call then).
          [](const grad::Plan& p, InArray total_norm, double max_norm) {
            return clip_by_rule(p, total_norm, max_norm, [](const Tensor& nt, double m, const Tensor& ct) {
              return grad::float_path_clip_coefficient(nt, m, ct);
            });
          },
          nb::arg("total_norm"), nb::arg("max_norm"))
      .def(
          "torch_rule_clip",
          // torch's clip given its norm: the coefficient from backend memory
          // (grad::torch_clip_coefficient), every grad scaled by it through the grad.scale
          // op (torch multiplies always, by 1 too).
          [](const grad::Plan& p, InArray total_norm, double max_norm) {
            clip_by_rule(p, total_norm, max_norm, [](const Tensor& nt, double m, const Tensor& ct) {
              grad::torch_clip_coefficient(nt, m, ct);
              return true;
            });
          },
          nb::arg("total_norm"), nb::arg("max_norm"))
      .def(
          "count_zeros",
          [](const grad::Plan& p, OutArray out_count) {
            const Tensor ct = to_tensor(out_count, "out_count");
            nb::gil_scoped_release release;
            ops::grad_count_zeros(p, ct);
          },
          nb::arg("out_count"));

  m.def(
      "grad_check_scalar",
      [](const nb::tuple& meta, const std::string& dtype, const std::string& where, const std::string& arg) {
        grad::check_scalar_arg(meta_tensor(meta, where, arg), dtype_from_name(dtype), where, arg);
      },
      nb::arg("meta"), nb::arg("dtype"), nb::arg("where"), nb::arg("arg"),
      "The rule of a 1-element backend scalar, on metadata (the device backends' outputs).");

  m.def(
      "grad_float_path_norm",
      [](InArray total, double exponent, OutArray out_norm) {
        const Tensor tt = to_tensor(total, "total"), nt = to_tensor(out_norm, "out_norm");
        grad::float_path_norm(tt, exponent, nt);
      },
      nb::arg("total"), nb::arg("exponent"), nb::arg("out_norm"));
  m.def(
      "grad_check_max_norm",
      [](double max_norm, const std::string& where) { grad::check_max_norm(max_norm, where); },
      nb::arg("max_norm"), nb::arg("where"),
      "The clip threshold's rule (finite, >= 0), shared by every backend.");

  m.def(
      "grad_multi_tensor_scale",
      [](const std::vector<InArray>& src, const std::vector<OutArray>& dst, InArray scale,
         OutArray found_inf) {
        const std::vector<Tensor> in = to_tensors(src, "src");
        const std::vector<Tensor> out = to_tensors(dst, "dst");
        const Tensor st = to_tensor(scale, "scale"), ft = to_tensor(found_inf, "found_inf");
        nb::gil_scoped_release release;
        ops::grad_multi_tensor_scale(in, out, st, ft);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("scale"), nb::arg("found_inf"));
  m.def(
      "grad_multi_tensor_scale",
      [](const std::vector<InArray>& src, const std::vector<OutArray>& dst, float scale,
         OutArray found_inf) {
        const std::vector<Tensor> in = to_tensors(src, "src");
        const std::vector<Tensor> out = to_tensors(dst, "dst");
        const Tensor ft = to_tensor(found_inf, "found_inf");
        nb::gil_scoped_release release;
        float scale_storage = scale;
        ops::grad_multi_tensor_scale(in, out, Tensor(&scale_storage, DType::kFloat32, {1}), ft);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("scale"), nb::arg("found_inf"));

  // Megatron-Core's param-and-grad buffer placement.
  m.def(
      "layout_build_ddp_buffers",
      [](const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string, bool, bool>>&
             params,
         bool distributed_optimizer, int dp_size, bool pad_for_high_busbw, int64_t bucket_size,
         const std::string& grad_dtype) {
        std::vector<layout::ParamSpec> specs;
        specs.reserve(params.size());
        for (const auto& [name, shape, dtype, is_expert, own_bucket] : params) {
          layout::ParamSpec s;
          s.name = name;
          s.shape = shape;
          s.dtype = dtype_from_name(dtype);
          s.is_expert = is_expert;
          s.own_bucket = own_bucket;
          specs.push_back(std::move(s));
        }
        layout::LayoutOptions options;
        options.distributed_optimizer = distributed_optimizer;
        options.dp_size = dp_size;
        options.pad_for_high_busbw = pad_for_high_busbw;
        options.bucket_size = bucket_size;
        options.grad_dtype = dtype_from_name(grad_dtype);
        nb::list out;
        for (const layout::BufferLayout& b : layout::build_ddp_buffers(specs, options))
          out.append(layout_dict(b));
        return out;
      },
      nb::arg("params"), nb::arg("distributed_optimizer") = false, nb::arg("dp_size") = 1,
      nb::arg("pad_for_high_busbw") = false, nb::arg("bucket_size") = 0,
      nb::arg("grad_dtype") = "float32",
      "params: (name, shape, param dtype, is_expert, own_bucket) in registration order.");

  // The realistic layouts the C++ benchmarks use, so peer benchmarks run on
  // the same tensors.
  m.def(
      "grad_model_params",
      [](const std::string& model, int lora_rank, int expert_parallel) {
        std::vector<layout::ParamSpec> specs;
        if (model == "qwen3_omni_lora") specs = fixtures::qwen3_omni_lora_rank_params(lora_rank, expert_parallel);
        else if (model == "dense_100m") specs = fixtures::dense_100m_params();
        else throw_arg_error("grad_model_params", "model",
                             "must be 'qwen3_omni_lora' or 'dense_100m' (got '" + model + "')");
        nb::list out;
        for (const layout::ParamSpec& p : specs)
          out.append(nb::make_tuple(p.name, nb::tuple(nb::cast(p.shape)), dtype_name(p.dtype),
                                    p.is_expert, p.own_bucket));
        return out;
      },
      nb::arg("model"), nb::arg("lora_rank") = 8, nb::arg("expert_parallel") = 8,
      "(name, shape, param dtype, is_expert, own_bucket) of a benchmark model, registration order.");
}

}  // namespace leanstep::py
