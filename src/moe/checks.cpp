#include "moe/checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <limits>

namespace leanstep::moe::detail {

void check_rows(const Tensor& t, const char* where, const char* name, int ndim, bool host) {
  check_tensor(t, where, name);
  if (host) check_cpu(t, where, name);
  LEANSTEP_CHECK_ARG(t.ndim == ndim, where, name, fmt::format("must have {} dims (got {})", ndim, t.describe()));
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, name, fmt::format("must be contiguous (got {})", t.describe()));
}

void check_map(const Tensor& t, const char* where, const char* name, bool host) {
  check_rows(t, where, name, 2, host);
  check_dtype(t, {DType::kBool}, where, name);
  LEANSTEP_CHECK_ARG(t.shape[1] >= 1, where, name, fmt::format("must have at least one expert (got {})", t.describe()));
}

void check_out(const Tensor& t, const char* where, const char* name, DType dtype,
               std::initializer_list<int64_t> shape, bool host) {
  check_tensor(t, where, name);
  if (host) check_cpu(t, where, name);
  check_dtype(t, {dtype}, where, name);
  bool ok = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) ok = ok && t.shape[d++] == s;
  LEANSTEP_CHECK_ARG(ok, where, name,
                     fmt::format("must have shape [{}] (got {})", fmt::join(shape, ", "), t.describe()));
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, name, fmt::format("must be contiguous (got {})", t.describe()));
}

IndexView check_indices(const Tensor& t, const char* where, const char* name, int64_t n, int64_t max_value,
                        bool host) {
  check_tensor(t, where, name);
  if (host) check_cpu(t, where, name);
  check_dtype(t, {DType::kInt64, DType::kInt32}, where, name);
  LEANSTEP_CHECK_ARG(t.ndim == 1 && t.shape[0] == n, where, name,
                     fmt::format("must have shape [{}] (got {})", n, t.describe()));
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, name, fmt::format("must be contiguous (got {})", t.describe()));
  if (t.dtype == DType::kInt32)
    LEANSTEP_CHECK_ARG(max_value <= std::numeric_limits<int32_t>::max(), where, name,
                       fmt::format("is int32 but must index up to {}: use int64", max_value));
  return IndexView{t.data, t.dtype == DType::kInt64};
}

void check_index_values(const IndexView& indices, int64_t n, int64_t T, const char* where) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = indices.get(i);
    if (v < -1 || v >= T)
      throw_arg_error(where, "sorted_indices",
                      fmt::format("must hold token indices in [-1, T={}) (got {} at position {})", T, v, i));
  }
}

void check_no_overlap(const Tensor& out, std::initializer_list<const Tensor*> inputs, const char* where,
                      const char* name) {
  if (out.empty()) return;
  for (const Tensor* in : inputs) {
    if (in == nullptr || in->empty()) continue;
    if (out.byte_begin() < in->byte_end() && in->byte_begin() < out.byte_end())
      throw_arg_error(where, name, fmt::format("must not overlap the memory of an input ({})", in->describe()));
  }
}

void check_slot_experts_args(const char* where, int64_t n, const Tensor& routing_map, bool drop_and_pad, bool host) {
  check_map(routing_map, where, "routing_map", host);
  const int64_t E = routing_map.shape[1];
  if (drop_and_pad)
    LEANSTEP_CHECK_ARG(n % E == 0, where, "sorted_indices",
                       fmt::format("must have E * capacity entries with drop_and_pad (got {}, E={})", n, E));
}

void check_slot_probs_args(const char* where, int64_t n, int64_t T, const Tensor* probs, const Tensor* routing_map,
                           bool drop_and_pad, bool host) {
  if (probs == nullptr) return;
  check_tensor(*probs, where, "probs");
  if (host) check_cpu(*probs, where, "probs");
  check_dtype(*probs, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, where, "probs");
  if (routing_map == nullptr) {
    check_rows(*probs, where, "probs", 1, host);
    LEANSTEP_CHECK_ARG(probs->shape[0] == n, where, "probs",
                       fmt::format("must be the [N={}] permuted probs when routing_map is not given (got {})", n,
                                   probs->describe()));
    return;
  }
  check_map(*routing_map, where, "routing_map", host);
  const int64_t E = routing_map->shape[1];
  LEANSTEP_CHECK_ARG(routing_map->shape[0] == T, where, "routing_map",
                     fmt::format("must have T={} rows like the output (got {})", T, routing_map->describe()));
  check_rows(*probs, where, "probs", 2, host);
  LEANSTEP_CHECK_ARG(probs->shape[0] == T && probs->shape[1] == E, where, "probs",
                     fmt::format("must have shape [{}, {}] like routing_map (got {})", T, E, probs->describe()));
  check_slot_experts_args(where, n, *routing_map, drop_and_pad, host);
}

std::vector<int64_t> slot_experts(const char* where, const IndexView& indices, int64_t n, const Tensor& routing_map,
                                  bool drop_and_pad) {
  check_slot_experts_args(where, n, routing_map, drop_and_pad);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  std::vector<int64_t> experts(static_cast<size_t>(n), -1);
  if (drop_and_pad) {
    const int64_t capacity = n / E;
    for (int64_t i = 0; i < n; ++i) experts[static_cast<size_t>(i)] = i / capacity;
    return experts;
  }
  const uint8_t* map = routing_map.data_as<const uint8_t>();
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) counts[static_cast<size_t>(e)] += map[t * E + e] != 0;
  int64_t slot = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = slot + counts[static_cast<size_t>(e)];
    LEANSTEP_CHECK_ARG(end <= n, where, "sorted_indices",
                       fmt::format("must have at least one entry per routed pair of routing_map (got {}, routed >= {})",
                                   n, end));
    for (; slot < end; ++slot) experts[static_cast<size_t>(slot)] = e;
  }
  for (int64_t i = slot; i < n; ++i)
    LEANSTEP_CHECK_ARG(indices.get(i) == -1, where, "sorted_indices",
                       fmt::format("must be -1 beyond the {} routed pairs of routing_map (got {} at position {})", slot,
                                   indices.get(i), i));
  return experts;
}

std::vector<float> slot_probs(const char* where, const IndexView& indices, int64_t n, int64_t T, const Tensor* probs,
                              const Tensor* routing_map, bool drop_and_pad, const std::vector<int64_t>* experts) {
  if (probs == nullptr) return {};
  check_slot_probs_args(where, n, T, probs, routing_map, drop_and_pad);
  std::vector<float> out(static_cast<size_t>(n), 0.0f);
  if (routing_map == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = load_f32(probs->data, probs->dtype, i);
    return out;
  }
  const int64_t E = routing_map->shape[1];
  const std::vector<int64_t> own = experts ? std::vector<int64_t>() : slot_experts(where, indices, n, *routing_map, drop_and_pad);
  const int64_t* expert = experts ? experts->data() : own.data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = indices.get(i);
    if (t >= 0) out[static_cast<size_t>(i)] = load_f32(probs->data, probs->dtype, t * E + expert[i]);
  }
  return out;
}

}  // namespace leanstep::moe::detail
