// Public MoE permutation API: argument validation (every bad input becomes a
// leanstep::Error naming the argument and the rule, before anything is
// written), then dispatch to the sort (reference) or fused implementation.
#include <fmt/format.h>

#include <cstring>
#include <limits>
#include <vector>

#include "leanstep/moe.h"
#include "moe/common.h"
#include "moe/checks.h"

namespace leanstep::moe {

using detail::IndexView;

Method method_from_name(std::string_view name) {
  if (name == "sort") return Method::kSort;
  if (name == "fused") return Method::kFused;
  throw_arg_error("method_from_name", "method", fmt::format("must be \"sort\" or \"fused\" (got \"{}\")", name));
}

const char* method_name(Method method) { return method == Method::kSort ? "sort" : "fused"; }

int64_t count_routed(const Tensor& routing_map) {
  detail::check_map(routing_map, "count_routed", "routing_map");
  const uint8_t* map = routing_map.data_as<const uint8_t>();
  const int64_t n = routing_map.numel();
  int64_t routed = 0;
  for (int64_t i = 0; i < n; ++i) routed += map[i] != 0;
  return routed;
}

namespace {

// num_out_tokens' rules; the row count when it is known without the map's values.
std::optional<int64_t> planned_rows(const char* where, int64_t T, int64_t E, std::optional<int64_t> num_out_tokens,
                                    bool drop_and_pad) {
  if (num_out_tokens)
    LEANSTEP_CHECK_ARG(*num_out_tokens >= 0, where, "num_out_tokens", fmt::format("must be >= 0 (got {})", *num_out_tokens));
  if (drop_and_pad) {
    LEANSTEP_CHECK_ARG(num_out_tokens.has_value(), where, "num_out_tokens",
                       "is required with drop_and_pad (it is E * capacity)");
    LEANSTEP_CHECK_ARG(*num_out_tokens % E == 0, where, "num_out_tokens",
                       fmt::format("must be a multiple of E={} with drop_and_pad (got {})", E, *num_out_tokens));
    LEANSTEP_CHECK_ARG(*num_out_tokens / E <= T, where, "num_out_tokens",
                       fmt::format("gives capacity {} > T={} (num_out_tokens / E must be <= T)", *num_out_tokens / E, T));
  }
  return num_out_tokens;
}

int64_t output_rows(const char* where, const Tensor& routing_map, std::optional<int64_t> num_out_tokens,
                    bool drop_and_pad) {
  detail::check_map(routing_map, where, "routing_map");
  const std::optional<int64_t> rows =
      planned_rows(where, routing_map.shape[0], routing_map.shape[1], num_out_tokens, drop_and_pad);
  return rows ? *rows : count_routed(routing_map);
}

// permute's rules on tokens, probs and the outputs of N rows (after the map's).
IndexView check_permute_layout(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs, int64_t N,
                               const Tensor& permuted, const Tensor* permuted_probs, const Tensor& sorted_indices,
                               bool host) {
  constexpr const char* where = "permute";
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  const int64_t H = tokens.shape[1];
  LEANSTEP_CHECK_ARG(tokens.shape[0] == T, where, "tokens",
                     fmt::format("must have T={} rows like routing_map (got {})", T, tokens.describe()));
  if (probs) {
    detail::check_rows(*probs, where, "probs", 2, host);
    LEANSTEP_CHECK_ARG(probs->shape[0] == T && probs->shape[1] == E, where, "probs",
                       fmt::format("must have shape [{}, {}] like routing_map (got {})", T, E, probs->describe()));
  }
  LEANSTEP_CHECK_ARG((probs == nullptr) == (permuted_probs == nullptr), where, "permuted_probs",
                     "must be given exactly when probs is given");
  detail::check_out(permuted, where, "permuted", tokens.dtype, {N, H}, host);
  if (permuted_probs) detail::check_out(*permuted_probs, where, "permuted_probs", probs->dtype, {N}, host);
  const IndexView indices = detail::check_indices(sorted_indices, where, "sorted_indices", N, T, host);
  detail::check_no_overlap(permuted, {&tokens, &routing_map, probs, &sorted_indices, permuted_probs}, where, "permuted");
  if (permuted_probs)
    detail::check_no_overlap(*permuted_probs, {&tokens, &routing_map, probs, &sorted_indices}, where, "permuted_probs");
  detail::check_no_overlap(sorted_indices, {&tokens, &routing_map, probs}, where, "sorted_indices");
  return indices;
}

}  // namespace

int64_t permute_output_rows(const Tensor& routing_map, std::optional<int64_t> num_out_tokens, bool drop_and_pad) {
  return output_rows("permute", routing_map, num_out_tokens, drop_and_pad);  // permute's rows, its rules
}

void check_permute_args(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                        std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                        const Tensor* permuted_probs, const Tensor& sorted_indices) {
  constexpr const char* where = "permute";
  detail::check_rows(tokens, where, "tokens", 2, false);
  detail::check_map(routing_map, where, "routing_map", false);
  const std::optional<int64_t> rows =
      planned_rows(where, routing_map.shape[0], routing_map.shape[1], num_out_tokens, drop_and_pad);
  // Without num_out_tokens the row count is the routed count, a value: the outputs' own.
  const int64_t N = rows ? *rows : (permuted.ndim >= 1 ? permuted.shape[0] : 0);
  check_permute_layout(tokens, routing_map, probs, N, permuted, permuted_probs, sorted_indices, false);
}

void permute(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
             std::optional<int64_t> num_out_tokens, bool drop_and_pad, Method method,
             const Tensor& permuted, const Tensor* permuted_probs, const Tensor& sorted_indices) {
  constexpr const char* where = "permute";
  detail::check_rows(tokens, where, "tokens", 2);
  const int64_t N = output_rows(where, routing_map, num_out_tokens, drop_and_pad);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  const int64_t H = tokens.shape[1];
  const IndexView indices =
      check_permute_layout(tokens, routing_map, probs, N, permuted, permuted_probs, sorted_indices, true);

  detail::PermuteProblem p;
  p.map = routing_map.data_as<const uint8_t>();
  p.T = T;
  p.E = E;
  p.tokens = static_cast<const char*>(tokens.data);
  p.row_bytes = static_cast<size_t>(H) * tokens.element_size();
  p.probs = probs ? static_cast<const char*>(probs->data) : nullptr;
  p.prob_bytes = probs ? probs->element_size() : 0;
  p.N = N;
  p.drop_and_pad = drop_and_pad;
  p.capacity = drop_and_pad ? N / E : 0;
  p.permuted = static_cast<char*>(permuted.data);
  p.permuted_probs = permuted_probs ? static_cast<char*>(permuted_probs->data) : nullptr;
  p.indices = indices;
  if (method == Method::kSort) detail::permute_sort(p);
  else detail::permute_fused(p);
}

namespace {

// unpermute's rules that need no values, with the names its callers use in error messages.
IndexView check_unpermute_layout(const char* where, const char* in_name, const char* out_name,
                                 const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                                 const Tensor* probs, const Tensor* routing_map, bool drop_and_pad, bool host) {
  detail::check_rows(permuted, where, in_name, 2, host);
  check_dtype(permuted, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, where, in_name);
  const int64_t N = permuted.shape[0], H = permuted.shape[1];
  detail::check_rows(out, where, out_name, 2, host);
  const int64_t T = out.shape[0];
  detail::check_out(out, where, out_name, permuted.dtype, {T, H}, host);
  const IndexView indices = detail::check_indices(sorted_indices, where, "sorted_indices", N, T, host);
  detail::check_slot_probs_args(where, N, T, probs, routing_map, drop_and_pad, host);
  detail::check_no_overlap(out, {&permuted, &sorted_indices, probs, routing_map}, where, out_name);
  return indices;
}

// unpermute's body.
void unpermute_impl(const char* where, const char* in_name, const char* out_name, const Tensor& permuted,
                    const Tensor& sorted_indices, const Tensor& out, const Tensor* probs, const Tensor* routing_map,
                    bool drop_and_pad, Method method) {
  const IndexView indices = check_unpermute_layout(where, in_name, out_name, permuted, sorted_indices, out, probs,
                                                   routing_map, drop_and_pad, true);
  const int64_t N = permuted.shape[0], H = permuted.shape[1], T = out.shape[0];
  detail::check_index_values(indices, N, T, where);
  const std::vector<float> slot_probs =
      detail::slot_probs(where, indices, N, T, probs, routing_map, drop_and_pad);

  detail::UnpermuteProblem p;
  p.permuted = static_cast<const char*>(permuted.data);
  p.dtype = permuted.dtype;
  p.N = N;
  p.H = H;
  p.T = T;
  p.indices = indices;
  p.slot_probs = probs ? slot_probs.data() : nullptr;
  p.out = static_cast<char*>(out.data);
  if (method == Method::kSort) detail::unpermute_sort(p);
  else detail::unpermute_fused(p);
}

}  // namespace

void check_unpermute_args(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out, const Tensor* probs,
                          const Tensor* routing_map, bool drop_and_pad) {
  check_unpermute_layout("unpermute", "permuted", "out", permuted, sorted_indices, out, probs, routing_map,
                         drop_and_pad, false);
}

void check_permute_backward_args(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens) {
  check_unpermute_layout("permute_backward", "dpermuted", "dtokens", dpermuted, sorted_indices, dtokens, nullptr,
                         nullptr, false, false);
}

void unpermute(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out, const Tensor* probs,
               const Tensor* routing_map, bool drop_and_pad, Method method) {
  unpermute_impl("unpermute", "permuted", "out", permuted, sorted_indices, out, probs, routing_map, drop_and_pad,
                 method);
}

void permute_backward(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens, Method method) {
  // The gather's adjoint is the scatter-add: unpermute without probs.
  unpermute_impl("permute_backward", "dpermuted", "dtokens", dpermuted, sorted_indices, dtokens, nullptr, nullptr,
                 false, method);
}

namespace {

IndexView check_permute_probs_backward_layout(const Tensor& dpermuted_probs, const Tensor& sorted_indices,
                                              const Tensor& routing_map, bool drop_and_pad, const Tensor& dprobs,
                                              bool host) {
  constexpr const char* where = "permute_probs_backward";
  detail::check_map(routing_map, where, "routing_map", host);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  detail::check_rows(dpermuted_probs, where, "dpermuted_probs", 1, host);
  check_dtype(dpermuted_probs, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}, where,
              "dpermuted_probs");
  const int64_t N = dpermuted_probs.shape[0];
  const IndexView indices = detail::check_indices(sorted_indices, where, "sorted_indices", N, T, host);
  check_tensor(dprobs, where, "dprobs");
  check_dtype(dprobs, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}, where, "dprobs");
  detail::check_out(dprobs, where, "dprobs", dprobs.dtype, {T, E}, host);
  detail::check_slot_experts_args(where, N, routing_map, drop_and_pad, host);
  detail::check_no_overlap(dprobs, {&dpermuted_probs, &sorted_indices, &routing_map}, where, "dprobs");
  return indices;
}

}  // namespace

void check_permute_probs_backward_args(const Tensor& dpermuted_probs, const Tensor& sorted_indices,
                                       const Tensor& routing_map, bool drop_and_pad, const Tensor& dprobs) {
  check_permute_probs_backward_layout(dpermuted_probs, sorted_indices, routing_map, drop_and_pad, dprobs, false);
}

namespace {

// Doubles stored as `out`'s dtype, each as store_from_double stores it: fp64 as they
// are; fp32, fp16 or bf16 rounded to float, then once to the dtype, in one bulk conversion.
void store_doubles(const std::vector<double>& values, const Tensor& out) {
  if (out.dtype == DType::kFloat64) {
    std::memcpy(out.data, values.data(), values.size() * sizeof(double));
    return;
  }
  const std::vector<float> as_float(values.begin(), values.end());
  convert_from_f32(as_float.data(), out.data, out.dtype, static_cast<int64_t>(as_float.size()));
}

}  // namespace

void permute_probs_backward(const Tensor& dpermuted_probs, const Tensor& sorted_indices, const Tensor& routing_map,
                            bool drop_and_pad, const Tensor& dprobs) {
  constexpr const char* where = "permute_probs_backward";
  const IndexView indices =
      check_permute_probs_backward_layout(dpermuted_probs, sorted_indices, routing_map, drop_and_pad, dprobs, true);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1], N = dpermuted_probs.shape[0];
  detail::check_index_values(indices, N, T, where);
  const std::vector<int64_t> experts = detail::slot_experts(where, indices, N, routing_map, drop_and_pad);
  std::vector<double> grad(static_cast<size_t>(T * E), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = indices.get(i);
    if (t >= 0) grad[static_cast<size_t>(t * E + experts[static_cast<size_t>(i)])] +=
        load_as_double(dpermuted_probs.data, dpermuted_probs.dtype, i);
  }
  store_doubles(grad, dprobs);
}

namespace {

IndexView check_unpermute_backward_layout(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                                          const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                                          const Tensor& dpermuted, const Tensor* dprobs, bool host) {
  constexpr const char* where = "unpermute_backward";
  detail::check_rows(permuted, where, "permuted", 2, host);
  check_dtype(permuted, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, where, "permuted");
  const int64_t N = permuted.shape[0], H = permuted.shape[1];
  detail::check_rows(dout, where, "dout", 2, host);
  const int64_t T = dout.shape[0];
  detail::check_out(dout, where, "dout", permuted.dtype, {T, H}, host);
  detail::check_out(dpermuted, where, "dpermuted", permuted.dtype, {N, H}, host);
  const IndexView indices = detail::check_indices(sorted_indices, where, "sorted_indices", N, T, host);
  detail::check_slot_probs_args(where, N, T, probs, routing_map, drop_and_pad, host);
  if (dprobs) {
    LEANSTEP_CHECK_ARG(probs != nullptr, where, "dprobs", "needs probs (it has probs' shape and dtype)");
    detail::check_out(*dprobs, where, "dprobs", probs->dtype,
                      routing_map ? std::initializer_list<int64_t>{T, routing_map->shape[1]}
                                  : std::initializer_list<int64_t>{N},
                      host);
    detail::check_no_overlap(*dprobs, {&dout, &permuted, &sorted_indices, probs, routing_map, &dpermuted}, where,
                             "dprobs");
  }
  detail::check_no_overlap(dpermuted, {&dout, &permuted, &sorted_indices, probs, routing_map}, where, "dpermuted");
  return indices;
}

}  // namespace

void check_unpermute_backward_args(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                                   const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                                   const Tensor& dpermuted, const Tensor* dprobs) {
  check_unpermute_backward_layout(dout, permuted, sorted_indices, probs, routing_map, drop_and_pad, dpermuted, dprobs,
                                  false);
}

void unpermute_backward(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices, const Tensor* probs,
                        const Tensor* routing_map, bool drop_and_pad, Method method, const Tensor& dpermuted,
                        const Tensor* dprobs) {
  constexpr const char* where = "unpermute_backward";
  const IndexView indices = check_unpermute_backward_layout(dout, permuted, sorted_indices, probs, routing_map,
                                                            drop_and_pad, dpermuted, dprobs, true);
  const int64_t N = permuted.shape[0], H = permuted.shape[1], T = dout.shape[0];
  detail::check_index_values(indices, N, T, where);
  // The expert of each slot, found once for the probs and for dprobs (its checks on
  // sorted_indices come before any work).
  const std::vector<int64_t> experts = probs && routing_map
                                           ? detail::slot_experts(where, indices, N, *routing_map, drop_and_pad)
                                           : std::vector<int64_t>();
  const std::vector<float> slot_probs =
      detail::slot_probs(where, indices, N, T, probs, routing_map, drop_and_pad, &experts);

  std::vector<double> dslot(dprobs ? static_cast<size_t>(N) : 0);
  detail::UnpermuteBackwardProblem p;
  p.dout = static_cast<const char*>(dout.data);
  p.permuted = static_cast<const char*>(permuted.data);
  p.dtype = permuted.dtype;
  p.N = N;
  p.H = H;
  p.T = T;
  p.indices = indices;
  p.slot_probs = probs ? slot_probs.data() : nullptr;
  p.dpermuted = static_cast<char*>(dpermuted.data);
  p.dslot_probs = dprobs ? dslot.data() : nullptr;
  if (method == Method::kSort) detail::unpermute_backward_sort(p);
  else detail::unpermute_backward_fused(p);
  if (!dprobs) return;
  if (!routing_map) {
    store_doubles(dslot, *dprobs);
    return;
  }
  const int64_t E = routing_map->shape[1];
  std::vector<double> grad(static_cast<size_t>(T * E), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = indices.get(i);
    if (t >= 0) grad[static_cast<size_t>(t * E + experts[static_cast<size_t>(i)])] += dslot[static_cast<size_t>(i)];
  }
  store_doubles(grad, *dprobs);
}

}  // namespace leanstep::moe
