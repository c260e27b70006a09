// MoE: routing, permute/unpermute and their backward, routing-map padding and
// chunk sorting. Outputs are caller-allocated (the Python layer allocates them
// in the inputs' framework).
#include <cstdint>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <leanstep/moe.h>
#include <leanstep/ops.h>

#include "arrays.h"
#include "bindings.h"

namespace leanstep::py {
namespace {

const Tensor* ptr(const std::optional<Tensor>& t) { return t ? &*t : nullptr; }

// Metadata (address, dtype, shape, strides) of an optional tensor, as a view.
std::optional<Tensor> meta(const std::optional<nb::tuple>& m, const char* where, const char* arg) {
  return m ? std::optional<Tensor>(meta_tensor(*m, where, arg)) : std::nullopt;
}

}  // namespace

void bind_moe(nb::module_& m) {
  // The argument rules on metadata ((address, dtype, shape, strides) each), for the
  // device backends: the same rules, and messages, as the CPU kernels'.
  m.def(
      "moe_check_permute",
      [](const nb::tuple& tokens, const nb::tuple& routing_map, std::optional<nb::tuple> probs,
         std::optional<int64_t> num_out_tokens, bool drop_and_pad, const nb::tuple& permuted,
         std::optional<nb::tuple> permuted_probs, const nb::tuple& sorted_indices) {
        const char* w = "permute";
        const auto p = meta(probs, w, "probs"), pp = meta(permuted_probs, w, "permuted_probs");
        moe::check_permute_args(meta_tensor(tokens, w, "tokens"), meta_tensor(routing_map, w, "routing_map"),
                                ptr(p), num_out_tokens, drop_and_pad, meta_tensor(permuted, w, "permuted"),
                                ptr(pp), meta_tensor(sorted_indices, w, "sorted_indices"));
      },
      nb::arg("tokens"), nb::arg("routing_map"), nb::arg("probs").none(), nb::arg("num_out_tokens").none(),
      nb::arg("drop_and_pad"), nb::arg("permuted"), nb::arg("permuted_probs").none(),
      nb::arg("sorted_indices"));
  m.def(
      "moe_check_unpermute",
      [](const nb::tuple& permuted, const nb::tuple& sorted_indices, const nb::tuple& out,
         std::optional<nb::tuple> probs, std::optional<nb::tuple> routing_map, bool drop_and_pad) {
        const char* w = "unpermute";
        const auto p = meta(probs, w, "probs"), rm = meta(routing_map, w, "routing_map");
        moe::check_unpermute_args(meta_tensor(permuted, w, "permuted"), meta_tensor(sorted_indices, w, "sorted_indices"),
                                  meta_tensor(out, w, "out"), ptr(p), ptr(rm), drop_and_pad);
      },
      nb::arg("permuted"), nb::arg("sorted_indices"), nb::arg("out"), nb::arg("probs").none(),
      nb::arg("routing_map").none(), nb::arg("drop_and_pad"));
  m.def(
      "moe_check_permute_backward",
      [](const nb::tuple& dpermuted, const nb::tuple& sorted_indices, const nb::tuple& dtokens) {
        const char* w = "permute_backward";
        moe::check_permute_backward_args(meta_tensor(dpermuted, w, "dpermuted"),
                                         meta_tensor(sorted_indices, w, "sorted_indices"),
                                         meta_tensor(dtokens, w, "dtokens"));
      },
      nb::arg("dpermuted"), nb::arg("sorted_indices"), nb::arg("dtokens"));
  m.def(
      "moe_check_permute_probs_backward",
      [](const nb::tuple& dpermuted_probs, const nb::tuple& sorted_indices, const nb::tuple& routing_map,
         bool drop_and_pad, const nb::tuple& dprobs) {
        const char* w = "permute_probs_backward";
        moe::check_permute_probs_backward_args(
            meta_tensor(dpermuted_probs, w, "dpermuted_probs"), meta_tensor(sorted_indices, w, "sorted_indices"),
            meta_tensor(routing_map, w, "routing_map"), drop_and_pad, meta_tensor(dprobs, w, "dprobs"));
      },
      nb::arg("dpermuted_probs"), nb::arg("sorted_indices"), nb::arg("routing_map"), nb::arg("drop_and_pad"),
      nb::arg("dprobs"));
  m.def(
      "moe_check_pad_routing_map",
      [](const nb::tuple& routing_map, int64_t multiple, const nb::tuple& out) {
        const char* w = "pad_routing_map";
        moe::check_pad_routing_map_args(meta_tensor(routing_map, w, "routing_map"), multiple,
                                        meta_tensor(out, w, "out"));
      },
      nb::arg("routing_map"), nb::arg("multiple"), nb::arg("out"));
  m.def(
      "moe_check_sort_chunks_by_idxs",
      [](const nb::tuple& rows, const nb::tuple& split_sizes, const nb::tuple& sorted_idxs, const nb::tuple& out,
         std::optional<nb::tuple> probs, std::optional<nb::tuple> out_probs) {
        const char* w = "sort_chunks_by_idxs";
        const auto p = meta(probs, w, "probs"), op = meta(out_probs, w, "out_probs");
        moe::check_sort_chunks_by_idxs_args(meta_tensor(rows, w, "rows"), meta_tensor(split_sizes, w, "split_sizes"),
                                            meta_tensor(sorted_idxs, w, "sorted_idxs"), meta_tensor(out, w, "out"),
                                            ptr(p), ptr(op));
      },
      nb::arg("rows"), nb::arg("split_sizes"), nb::arg("sorted_idxs"), nb::arg("out"), nb::arg("probs").none(),
      nb::arg("out_probs").none());
  m.def(
      "moe_check_unpermute_backward",
      [](const nb::tuple& dout, const nb::tuple& permuted, const nb::tuple& sorted_indices,
         std::optional<nb::tuple> probs, std::optional<nb::tuple> routing_map, bool drop_and_pad,
         const nb::tuple& dpermuted, std::optional<nb::tuple> dprobs) {
        const char* w = "unpermute_backward";
        const auto p = meta(probs, w, "probs"), rm = meta(routing_map, w, "routing_map");
        const auto dp = meta(dprobs, w, "dprobs");
        moe::check_unpermute_backward_args(meta_tensor(dout, w, "dout"), meta_tensor(permuted, w, "permuted"),
                                           meta_tensor(sorted_indices, w, "sorted_indices"), ptr(p), ptr(rm),
                                           drop_and_pad, meta_tensor(dpermuted, w, "dpermuted"), ptr(dp));
      },
      nb::arg("dout"), nb::arg("permuted"), nb::arg("sorted_indices"), nb::arg("probs").none(),
      nb::arg("routing_map").none(), nb::arg("drop_and_pad"), nb::arg("dpermuted"), nb::arg("dprobs").none());

  m.def("moe_expert_capacity", &moe::expert_capacity, nb::arg("num_tokens"),
        nb::arg("num_experts"), nb::arg("topk"), nb::arg("capacity_factor"));

  m.def(
      "moe_route",
      [](InArray logits, int64_t topk, const std::string& score_function, bool pre_softmax,
         std::optional<bool> normalize, std::optional<double> scaling_factor,
         std::optional<double> capacity_factor, const std::string& drop_policy,
         bool pad_to_capacity, std::optional<InArray> expert_bias, OutArray routing_map,
         OutArray probs, OutArray tokens_per_expert) {
        moe::RoutingConfig config;
        config.topk = topk;
        config.score_function = moe::score_function_from_name(score_function);
        config.pre_softmax = pre_softmax;
        config.normalize = normalize;
        config.scaling_factor = scaling_factor;
        config.capacity_factor = capacity_factor;
        config.drop_policy = moe::drop_policy_from_name(drop_policy);
        config.pad_to_capacity = pad_to_capacity;
        const Tensor lt = to_tensor(logits, "logits");
        const std::optional<Tensor> bias = to_tensor(expert_bias, "expert_bias");
        const Tensor mt = to_tensor(routing_map, "routing_map"), pt = to_tensor(probs, "probs");
        const Tensor tt = to_tensor(tokens_per_expert, "tokens_per_expert");
        nb::gil_scoped_release release;
        ops::moe_route(lt, config, ptr(bias), mt, pt, tt);
      },
      nb::arg("logits"), nb::arg("topk"), nb::arg("score_function") = "softmax",
      nb::arg("pre_softmax") = false, nb::arg("normalize").none() = nb::none(),
      nb::arg("scaling_factor").none() = nb::none(),
      nb::arg("capacity_factor").none() = nb::none(), nb::arg("drop_policy") = "probs",
      nb::arg("pad_to_capacity") = false, nb::arg("expert_bias").none() = nb::none(),
      nb::kw_only(), nb::arg("routing_map"), nb::arg("probs"), nb::arg("tokens_per_expert"));

  m.def(
      "moe_count_routed",
      [](InArray routing_map) {
        const Tensor t = to_tensor(routing_map, "routing_map");
        nb::gil_scoped_release release;
        return moe::count_routed(t);
      },
      nb::arg("routing_map"));

  m.def(
      "moe_permute_output_rows",
      [](InArray routing_map, std::optional<int64_t> num_out_tokens, bool drop_and_pad) {
        const Tensor t = to_tensor(routing_map, "routing_map");
        nb::gil_scoped_release release;
        return moe::permute_output_rows(t, num_out_tokens, drop_and_pad);
      },
      nb::arg("routing_map"), nb::arg("num_out_tokens").none(), nb::arg("drop_and_pad"));

  m.def(
      "moe_permute",
      [](InArray tokens, InArray routing_map, std::optional<InArray> probs,
         std::optional<int64_t> num_out_tokens, bool drop_and_pad, const std::string& method,
         OutArray permuted, std::optional<OutArray> permuted_probs, OutArray sorted_indices) {
        const Tensor tt = to_tensor(tokens, "tokens"), mt = to_tensor(routing_map, "routing_map");
        const std::optional<Tensor> pt = to_tensor(probs, "probs");
        const Tensor outt = to_tensor(permuted, "permuted");
        const std::optional<Tensor> outp = to_tensor(permuted_probs, "permuted_probs");
        const Tensor st = to_tensor(sorted_indices, "sorted_indices");
        if (method == "auto") {  // the registry chooses (preset, guards, counts)
          nb::gil_scoped_release release;
          ops::moe_permute(tt, mt, ptr(pt), num_out_tokens, drop_and_pad, outt, ptr(outp), st);
          return;
        }
        const moe::Method mth = moe::method_from_name(method);
        nb::gil_scoped_release release;
        moe::permute(tt, mt, ptr(pt), num_out_tokens, drop_and_pad, mth, outt, ptr(outp), st);
      },
      nb::arg("tokens"), nb::arg("routing_map"), nb::arg("probs").none(),
      nb::arg("num_out_tokens").none(), nb::arg("drop_and_pad"), nb::arg("method"),
      nb::arg("permuted"), nb::arg("permuted_probs").none(), nb::arg("sorted_indices"));

  m.def(
      "moe_unpermute",
      [](InArray permuted, InArray sorted_indices, OutArray out, std::optional<InArray> probs,
         std::optional<InArray> routing_map, bool drop_and_pad, const std::string& method) {
        const Tensor pt = to_tensor(permuted, "permuted");
        const Tensor st = to_tensor(sorted_indices, "sorted_indices");
        const Tensor ot = to_tensor(out, "out");
        const std::optional<Tensor> prt = to_tensor(probs, "probs");
        const std::optional<Tensor> mt = to_tensor(routing_map, "routing_map");
        if (method == "auto") {
          nb::gil_scoped_release release;
          ops::moe_unpermute(pt, st, ot, ptr(prt), ptr(mt), drop_and_pad);
          return;
        }
        const moe::Method mth = moe::method_from_name(method);
        nb::gil_scoped_release release;
        moe::unpermute(pt, st, ot, ptr(prt), ptr(mt), drop_and_pad, mth);
      },
      nb::arg("permuted"), nb::arg("sorted_indices"), nb::arg("out"), nb::arg("probs").none(),
      nb::arg("routing_map").none(), nb::arg("drop_and_pad"), nb::arg("method"));

  m.def(
      "moe_permute_backward",
      [](InArray dpermuted, InArray sorted_indices, OutArray dtokens, const std::string& method) {
        const Tensor dp = to_tensor(dpermuted, "dpermuted");
        const Tensor st = to_tensor(sorted_indices, "sorted_indices");
        const Tensor dt = to_tensor(dtokens, "dtokens");
        if (method == "auto") {
          nb::gil_scoped_release release;
          ops::moe_permute_backward(dp, st, dt);
          return;
        }
        const moe::Method mth = moe::method_from_name(method);
        nb::gil_scoped_release release;
        moe::permute_backward(dp, st, dt, mth);
      },
      nb::arg("dpermuted"), nb::arg("sorted_indices"), nb::arg("dtokens"), nb::arg("method"));

  m.def(
      "moe_permute_probs_backward",
      [](InArray dpermuted_probs, InArray sorted_indices, InArray routing_map, bool drop_and_pad,
         OutArray dprobs) {
        const Tensor dp = to_tensor(dpermuted_probs, "dpermuted_probs");
        const Tensor st = to_tensor(sorted_indices, "sorted_indices");
        const Tensor mt = to_tensor(routing_map, "routing_map");
        const Tensor dt = to_tensor(dprobs, "dprobs");
        nb::gil_scoped_release release;
        ops::moe_permute_probs_backward(dp, st, mt, drop_and_pad, dt);
      },
      nb::arg("dpermuted_probs"), nb::arg("sorted_indices"), nb::arg("routing_map"),
      nb::arg("drop_and_pad"), nb::arg("dprobs"));

  m.def(
      "moe_unpermute_backward",
      [](InArray dout, InArray permuted, InArray sorted_indices, std::optional<InArray> probs,
         std::optional<InArray> routing_map, bool drop_and_pad, const std::string& method,
         OutArray dpermuted, std::optional<OutArray> dprobs) {
        const Tensor dt = to_tensor(dout, "dout"), pt = to_tensor(permuted, "permuted");
        const Tensor st = to_tensor(sorted_indices, "sorted_indices");
        const std::optional<Tensor> prt = to_tensor(probs, "probs");
        const std::optional<Tensor> mt = to_tensor(routing_map, "routing_map");
        const Tensor dpt = to_tensor(dpermuted, "dpermuted");
        const std::optional<Tensor> dprt = to_tensor(dprobs, "dprobs");
        if (method == "auto") {
          nb::gil_scoped_release release;
          ops::moe_unpermute_backward(dt, pt, st, ptr(prt), ptr(mt), drop_and_pad, dpt, ptr(dprt));
          return;
        }
        const moe::Method mth = moe::method_from_name(method);
        nb::gil_scoped_release release;
        moe::unpermute_backward(dt, pt, st, ptr(prt), ptr(mt), drop_and_pad, mth, dpt, ptr(dprt));
      },
      nb::arg("dout"), nb::arg("permuted"), nb::arg("sorted_indices"), nb::arg("probs").none(),
      nb::arg("routing_map").none(), nb::arg("drop_and_pad"), nb::arg("method"),
      nb::arg("dpermuted"), nb::arg("dprobs").none());

  m.def(
      "moe_pad_routing_map",
      [](InArray routing_map, int64_t multiple, OutArray out) {
        const Tensor mt = to_tensor(routing_map, "routing_map"), ot = to_tensor(out, "out");
        nb::gil_scoped_release release;
        ops::moe_pad_routing_map(mt, multiple, ot);
      },
      nb::arg("routing_map"), nb::arg("multiple"), nb::arg("out"));

  m.def(
      "moe_sort_chunks_by_idxs",
      [](InArray rows, InArray split_sizes, InArray sorted_idxs, OutArray out,
         std::optional<InArray> probs, std::optional<OutArray> out_probs) {
        const Tensor rt = to_tensor(rows, "rows"), st = to_tensor(split_sizes, "split_sizes");
        const Tensor it = to_tensor(sorted_idxs, "sorted_idxs"), ot = to_tensor(out, "out");
        const std::optional<Tensor> pt = to_tensor(probs, "probs");
        const std::optional<Tensor> opt = to_tensor(out_probs, "out_probs");
        nb::gil_scoped_release release;
        ops::moe_sort_chunks_by_idxs(rt, st, it, ot, ptr(pt), ptr(opt));
      },
      nb::arg("rows"), nb::arg("split_sizes"), nb::arg("sorted_idxs"), nb::arg("out"),
      nb::arg("probs").none() = nb::none(), nb::arg("out_probs").none() = nb::none());
}

}  // namespace leanstep::py
