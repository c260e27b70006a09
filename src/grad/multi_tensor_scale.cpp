// multi_tensor_scale: out[i] = cast(float(in[i]) * scale) over lists of views.
// Pairs with no memory shared across pairs run in one dispatch, chunked;
// a pair whose input and output partially overlap is staged through an fp32
// temporary (read everything, then write); when pairs share memory with each
// other the pairs run one after the other, in list order.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "grad/checks.h"
#include "grad/kernels.h"
#include "leanstep/grad.h"

namespace leanstep::grad {
namespace {

constexpr int64_t kBlock = 2048;  // fp32 staging block (fits L1 with its source)

struct Item {
  size_t pair;
  int64_t begin = 0, end = 0;  // element range (chunked pairs)
  bool staged = false;         // whole pair through a temporary
};

bool overlaps(const Tensor& a, const Tensor& b) {
  return !a.empty() && !b.empty() && a.byte_begin() < b.byte_end() && b.byte_begin() < a.byte_end();
}

bool same_view(const Tensor& a, const Tensor& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

// Checks and scales `n` fp32 values in place; returns true if any input was non-finite.
bool check_and_scale(float* values, int64_t n, float scale) {
  float probe = 0.0f;  // inf * 0 and NaN * 0 are NaN
  for (int64_t i = 0; i < n; ++i) {
    probe += values[i] * 0.0f;
    values[i] *= scale;
  }
  return std::isnan(probe);
}

bool run_chunk(const Tensor& in, const Tensor& out, int64_t begin, int64_t end, float scale) {
  float block[kBlock];
  bool nonfinite = false;
  const auto in_es = static_cast<int64_t>(in.element_size()), out_es = static_cast<int64_t>(out.element_size());
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    convert_to_f32(static_cast<const char*>(in.data) + b * in_es, in.dtype, block, n);
    nonfinite |= check_and_scale(block, n, scale);
    convert_from_f32(block, static_cast<char*>(out.data) + b * out_es, out.dtype, n);
  }
  return nonfinite;
}

bool run_staged(const Tensor& in, const Tensor& out, float scale) {
  const int64_t n = in.numel();
  std::vector<float> values(static_cast<size_t>(n));
  if (in.is_contiguous()) {
    convert_to_f32(in.data, in.dtype, values.data(), n);
  } else {
    const auto offsets = detail::element_offsets(in);
    for (int64_t e = 0; e < n; ++e)
      values[static_cast<size_t>(e)] = static_cast<float>(load_as_double(in.data, in.dtype, offsets[static_cast<size_t>(e)]));
  }
  const bool nonfinite = check_and_scale(values.data(), n, scale);
  if (out.is_contiguous()) {
    convert_from_f32(values.data(), out.data, out.dtype, n);
  } else {
    const auto offsets = detail::element_offsets(out);
    for (int64_t e = 0; e < n; ++e)
      store_from_double(out.data, out.dtype, offsets[static_cast<size_t>(e)], values[static_cast<size_t>(e)]);
  }
  return nonfinite;
}

// True when some pair's output shares memory with another pair's input or output.
bool pairs_share_memory(std::span<const Tensor> in, std::span<const Tensor> out) {
  struct Span {
    uintptr_t begin, end;
    size_t pair;
    bool is_out;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].empty()) continue;
    spans.push_back({in[i].byte_begin(), in[i].byte_end(), i, false});
    spans.push_back({out[i].byte_begin(), out[i].byte_end(), i, true});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  std::vector<Span> active;
  for (const Span& s : spans) {
    std::erase_if(active, [&](const Span& a) { return a.end <= s.begin; });
    for (const Span& a : active)
      if (a.pair != s.pair && (a.is_out || s.is_out)) return true;
    active.push_back(s);
  }
  return false;
}

}  // namespace

void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, const Tensor& scale,
                        const Tensor& found_inf) {
  static constexpr const char* kWhere = "grad::multi_tensor_scale";
  LEANSTEP_CHECK_ARG(in.size() == out.size(), kWhere, "out",
                     fmt::format("must have as many tensors as 'in' ({}) (got {})", in.size(), out.size()));
  detail::check_scalar(scale, DType::kFloat32, kWhere, "scale");
  detail::check_scalar(found_inf, DType::kFloat32, kWhere, "found_inf");
  for (size_t i = 0; i < in.size(); ++i) {
    detail::check_grad_view(in[i], kWhere, fmt::format("in[{}]", i));
    detail::check_grad_view(out[i], kWhere, fmt::format("out[{}]", i));
    check_no_self_overlap(out[i], kWhere, fmt::format("out[{}]", i));
    LEANSTEP_CHECK_ARG(in[i].numel() == out[i].numel(), kWhere, fmt::format("out[{}]", i),
                       fmt::format("must have the numel of in[{}] ({}) (got {})", i, in[i].numel(), out[i].numel()));
  }
  // Work items, grouped by pair (in list order).
  std::vector<std::vector<Item>> items(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const int64_t n = in[i].numel();
    if (n == 0) continue;
    const bool in_place = same_view(in[i], out[i]);
    const bool fast = in[i].is_contiguous() && out[i].is_contiguous() && (in_place || !overlaps(in[i], out[i]));
    if (!fast) {
      items[i].push_back({i, 0, n, true});
      continue;
    }
    for (int64_t b = 0; b < n; b += Plan::kChunkElements)
      items[i].push_back({i, b, std::min(n, b + Plan::kChunkElements), false});
  }
  const float* scale_ptr = scale.data_as<const float>();
  auto run_items = [&](const std::vector<Item>& list) {
    std::vector<uint8_t> flags(list.size(), 0);
    leanstep::detail::parallel_items(static_cast<int64_t>(list.size()), [&](int64_t k) {
      const Item& it = list[static_cast<size_t>(k)];
      const float s = *scale_ptr;
      flags[static_cast<size_t>(k)] = it.staged ? run_staged(in[it.pair], out[it.pair], s)
                                                : run_chunk(in[it.pair], out[it.pair], it.begin, it.end, s);
    });
    if (std::find(flags.begin(), flags.end(), 1) != flags.end()) *found_inf.data_as<float>() = 1.0f;
  };
  if (pairs_share_memory(in, out)) {
    for (const auto& pair_items : items) run_items(pair_items);  // the per-tensor order
  } else {
    std::vector<Item> all;
    for (const auto& pair_items : items) all.insert(all.end(), pair_items.begin(), pair_items.end());
    run_items(all);
  }
}

void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, float scale,
                        const Tensor& found_inf) {
  float storage = scale;
  multi_tensor_scale(in, out, Tensor(&storage, DType::kFloat32, {1}), found_inf);
}

}  // namespace leanstep::grad
