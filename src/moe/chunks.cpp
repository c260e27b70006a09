// Routing-map padding (for grouped GEMMs / FP8 alignment) and chunk sorting
// (regrouping rows by local expert after the expert-parallel all-to-all).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "leanstep/moe.h"
#include "moe/checks.h"

namespace leanstep::moe {

namespace {

void check_pad_layout(const Tensor& routing_map, int64_t multiple, const Tensor& out, bool host) {
  constexpr const char* where = "pad_routing_map";
  detail::check_map(routing_map, where, "routing_map", host);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  LEANSTEP_CHECK_ARG(multiple >= 1, where, "multiple", fmt::format("must be >= 1 (got {})", multiple));
  detail::check_out(out, where, "out", DType::kBool, {T, E}, host);
  const bool in_place = out.data == routing_map.data;
  if (!in_place) detail::check_no_overlap(out, {&routing_map}, where, "out");
}

// Returns (split sizes, order) as index views.
std::pair<detail::IndexView, detail::IndexView> check_sort_chunks_layout(const Tensor& rows, const Tensor& split_sizes,
                                                                         const Tensor& sorted_idxs, const Tensor& out,
                                                                         const Tensor* probs, const Tensor* out_probs,
                                                                         bool host) {
  constexpr const char* where = "sort_chunks_by_idxs";
  check_tensor(rows, where, "rows");
  if (host) check_cpu(rows, where, "rows");
  LEANSTEP_CHECK_ARG(rows.ndim >= 1 && rows.is_contiguous(), where, "rows",
                     fmt::format("must be a contiguous tensor with a row dim (got {})", rows.describe()));
  const int64_t R = rows.shape[0];
  const int64_t C = split_sizes.ndim == 1 ? split_sizes.shape[0] : -1;
  LEANSTEP_CHECK_ARG(C >= 0, where, "split_sizes", fmt::format("must be 1-D (got {})", split_sizes.describe()));
  const detail::IndexView sizes = detail::check_indices(split_sizes, where, "split_sizes", C, R, host);
  const detail::IndexView order = detail::check_indices(sorted_idxs, where, "sorted_idxs", C, C, host);
  auto check_like = [&](const Tensor& t, const Tensor& like, const char* name) {
    check_tensor(t, where, name);
    if (host) check_cpu(t, where, name);
    bool same = t.dtype == like.dtype && t.ndim == like.ndim && t.is_contiguous();
    for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == like.shape[d];
    LEANSTEP_CHECK_ARG(same, where, name, fmt::format("must be contiguous and match {} (got {})", like.describe(), t.describe()));
  };
  check_like(out, rows, "out");
  LEANSTEP_CHECK_ARG((probs == nullptr) == (out_probs == nullptr), where, "out_probs",
                     "must be given exactly when probs is given");
  if (probs) {
    check_tensor(*probs, where, "probs");
    if (host) check_cpu(*probs, where, "probs");
    LEANSTEP_CHECK_ARG(probs->ndim >= 1 && probs->shape[0] == R && probs->is_contiguous(), where, "probs",
                       fmt::format("must be contiguous with R={} rows like rows (got {})", R, probs->describe()));
    check_like(*out_probs, *probs, "out_probs");
    detail::check_no_overlap(*out_probs, {&rows, &split_sizes, &sorted_idxs, probs, &out}, where, "out_probs");
  }
  detail::check_no_overlap(out, {&rows, &split_sizes, &sorted_idxs, probs}, where, "out");
  return {sizes, order};
}

}  // namespace

void check_pad_routing_map_args(const Tensor& routing_map, int64_t multiple, const Tensor& out) {
  check_pad_layout(routing_map, multiple, out, false);
}

void check_sort_chunks_by_idxs_args(const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs,
                                    const Tensor& out, const Tensor* probs, const Tensor* out_probs) {
  check_sort_chunks_layout(rows, split_sizes, sorted_idxs, out, probs, out_probs, false);
}

void pad_routing_map(const Tensor& routing_map, int64_t multiple, const Tensor& out) {
  check_pad_layout(routing_map, multiple, out, true);
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];

  const uint8_t* map = routing_map.data_as<const uint8_t>();
  uint8_t* result = out.data_as<uint8_t>();
  // Count first (the map may be `out` itself), then copy and switch on the first
  // (-count mod multiple) unrouted tokens of every expert, in token order.
  std::vector<int64_t> to_pad(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) to_pad[static_cast<size_t>(e)] += map[t * E + e] != 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = to_pad[static_cast<size_t>(e)];
    to_pad[static_cast<size_t>(e)] = (multiple - count % multiple) % multiple;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t j = t * E + e;
      uint8_t on = map[j] != 0;
      if (!on && to_pad[static_cast<size_t>(e)] > 0) {
        on = 1;
        --to_pad[static_cast<size_t>(e)];
      }
      result[j] = on;
    }
  }
}

void sort_chunks_by_idxs(const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs, const Tensor& out,
                         const Tensor* probs, const Tensor* out_probs) {
  constexpr const char* where = "sort_chunks_by_idxs";
  // Not a structured binding: the lambdas below capture these (clang 14 cannot).
  const auto checked = check_sort_chunks_layout(rows, split_sizes, sorted_idxs, out, probs, out_probs, true);
  const detail::IndexView sizes = checked.first, order = checked.second;
  const int64_t R = rows.shape[0], C = split_sizes.shape[0];

  // Source offsets of the chunks; sizes non-negative and summing within the rows.
  std::vector<int64_t> source_start(static_cast<size_t>(C) + 1, 0);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t s = sizes.get(c);
    LEANSTEP_CHECK_ARG(s >= 0, where, "split_sizes", fmt::format("must be >= 0 (got {} at position {})", s, c));
    source_start[static_cast<size_t>(c + 1)] = source_start[static_cast<size_t>(c)] + s;
    LEANSTEP_CHECK_ARG(source_start[static_cast<size_t>(c + 1)] <= R, where, "split_sizes",
                       fmt::format("must sum to at most the {} rows (prefix of {} sums to {})", R, c + 1,
                                   source_start[static_cast<size_t>(c + 1)]));
  }
  std::vector<uint8_t> seen(static_cast<size_t>(C), 0);
  for (int64_t j = 0; j < C; ++j) {
    const int64_t c = order.get(j);
    LEANSTEP_CHECK_ARG(c >= 0 && c < C && !seen[static_cast<size_t>(c)], where, "sorted_idxs",
                       fmt::format("must be a permutation of 0..{} (got {} at position {})", C - 1, c, j));
    seen[static_cast<size_t>(c)] = 1;
  }

  // Output chunk j is source chunk order[j]; the tail beyond the chunks stays in place.
  const int64_t covered = source_start[static_cast<size_t>(C)];
  std::vector<int64_t> dest_start(static_cast<size_t>(C) + 1, 0);
  for (int64_t j = 0; j < C; ++j)
    dest_start[static_cast<size_t>(j + 1)] = dest_start[static_cast<size_t>(j)] + sizes.get(order.get(j));
  auto move = [&](const Tensor& src, const Tensor& dst) {
    const size_t row_bytes = R == 0 ? 0 : src.nbytes() / static_cast<size_t>(R);
    const char* s = static_cast<const char*>(src.data);
    char* d = static_cast<char*>(dst.data);
    leanstep::detail::parallel_items(C + 1, [&](int64_t j) {
      if (j == C) {
        if (R > covered)
          std::memcpy(d + static_cast<size_t>(covered) * row_bytes, s + static_cast<size_t>(covered) * row_bytes,
                      static_cast<size_t>(R - covered) * row_bytes);
        return;
      }
      const int64_t c = order.get(j);
      const int64_t n = sizes.get(c);
      if (n > 0)
        std::memcpy(d + static_cast<size_t>(dest_start[static_cast<size_t>(j)]) * row_bytes,
                    s + static_cast<size_t>(source_start[static_cast<size_t>(c)]) * row_bytes,
                    static_cast<size_t>(n) * row_bytes);
    });
  };
  move(rows, out);
  if (probs) move(*probs, *out_probs);
}

}  // namespace leanstep::moe
