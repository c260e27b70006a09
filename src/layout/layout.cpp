// Megatron-Core DDP buffer placement (see include/leanstep/layout.h).
#include "leanstep/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace leanstep::layout {
namespace {

int64_t round_up(int64_t value, int64_t divisor) { return (value + divisor - 1) / divisor * divisor; }

int64_t bucket_end_divisor(const LayoutOptions& o) {
  int64_t d = std::lcm(static_cast<int64_t>(o.dp_size), int64_t{128});
  if (o.pad_for_high_busbw) d = std::lcm(d, int64_t{1} << 16);
  return d;
}

void check_options(const LayoutOptions& o) {
  LEANSTEP_CHECK_ARG(o.dp_size >= 1, "build_buffer_layout", "dp_size", fmt::format("must be >= 1 (got {})", o.dp_size));
  LEANSTEP_CHECK_ARG(o.bucket_size >= 0, "build_buffer_layout", "bucket_size",
                     fmt::format("must be >= 0 (got {})", o.bucket_size));
  LEANSTEP_CHECK_ARG(is_floating(o.grad_dtype), "build_buffer_layout", "grad_dtype", "must be a floating dtype");
}

int64_t param_numel(const ParamSpec& p) {
  LEANSTEP_CHECK_ARG(p.shape.size() <= static_cast<size_t>(kMaxDims), "build_buffer_layout", "params",
                     fmt::format("'{}' must have at most {} dims", p.name, kMaxDims));
  int64_t n = 1;
  for (int64_t s : p.shape) {
    LEANSTEP_CHECK_ARG(s >= 0, "build_buffer_layout", "params",
                       fmt::format("'{}' must have non-negative sizes", p.name));
    n *= s;
  }
  return n;
}

// Lays out params[indices[...]] (registration order) into one buffer.
BufferLayout layout_group(const std::vector<ParamSpec>& params, const std::vector<size_t>& indices,
                          const LayoutOptions& o) {
  BufferLayout out;
  out.grad_dtype = o.grad_dtype;
  if (!indices.empty()) {
    out.param_dtype = params[indices.front()].dtype;
    out.is_expert = params[indices.front()].is_expert;
  }
  const bool dist = o.distributed_optimizer;
  const int64_t divisor = bucket_end_divisor(o);
  auto pad_end = [&](int64_t end) { return dist ? round_up(end, divisor) : end; };
  auto pad_start = [&](int64_t start) { return dist ? round_up(start, 64) : start; };

  std::vector<ParamSlot> slots(indices.size());
  int64_t start = 0, bucket_start = 0, end = 0;
  size_t bucket_params = 0;
  auto close_bucket = [&](int64_t last_end) {
    BucketRange b;
    b.begin = bucket_start;
    b.numel_unpadded = last_end - bucket_start;  // as Megatron counts it (includes start padding)
    b.end = pad_end(last_end);
    out.buckets.push_back(b);
    bucket_start = b.end;
    bucket_params = 0;
    return b.end;
  };
  // Reverse registration order: the last registered param sits at offset 0.
  for (size_t k = indices.size(); k-- > 0;) {
    const ParamSpec& p = params[indices[k]];
    const int64_t numel = param_numel(p);
    const bool own = p.own_bucket && dist;
    start = pad_start(start);
    if (own && bucket_params > 0) start = close_bucket(start);
    end = start + numel;
    ParamSlot& s = slots[k];
    s.name = p.name;
    s.shape = p.shape;
    s.param_index = indices[k];
    s.offset = start;
    s.numel = numel;
    s.bucket = static_cast<int>(out.buckets.size());
    ++bucket_params;
    if ((o.bucket_size > 0 && end - bucket_start >= o.bucket_size) || own) {
      start = close_bucket(end);
    } else {
      start = end;
    }
  }
  if (bucket_params > 0) close_bucket(end);
  out.numel = out.buckets.empty() ? 0 : out.buckets.back().end;
  for (const auto& s : slots) out.numel_unpadded += s.numel;
  out.params = std::move(slots);
  return out;
}

}  // namespace

Tensor BufferLayout::view(size_t i, void* base) const {
  LEANSTEP_CHECK_ARG(i < params.size(), "BufferLayout::view", "i",
                     fmt::format("must be < {} (got {})", params.size(), i));
  const ParamSlot& s = params[i];
  char* p = static_cast<char*>(base) + s.offset * static_cast<int64_t>(dtype_size(grad_dtype));
  return Tensor::contiguous(p, grad_dtype, s.shape.data(), static_cast<int>(s.shape.size()));
}

std::vector<Tensor> BufferLayout::views(void* base) const {
  std::vector<Tensor> out;
  out.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) out.push_back(view(i, base));
  return out;
}

Tensor BufferLayout::buffer_view(void* base) const {
  const int64_t shape[1] = {numel};
  return Tensor::contiguous(base, grad_dtype, shape, 1);
}

std::string BufferLayout::summary() const {
  std::string s = fmt::format("{} buffer ({} params, {} grads): {} params, {} buckets, {} elements ({} padding), {:.1f} MiB\n",
                              is_expert ? "expert" : "dense", dtype_name(param_dtype), dtype_name(grad_dtype),
                              params.size(), buckets.size(), numel, numel - numel_unpadded,
                              static_cast<double>(nbytes()) / (1 << 20));
  for (size_t b = 0; b < buckets.size(); ++b)
    s += fmt::format("  bucket {}: [{}, {}) {} elements\n", b, buckets[b].begin, buckets[b].end,
                     buckets[b].end - buckets[b].begin);
  return s;
}

BufferLayout build_buffer_layout(const std::vector<ParamSpec>& params, const LayoutOptions& options) {
  check_options(options);
  std::vector<size_t> all(params.size());
  std::iota(all.begin(), all.end(), size_t{0});
  return layout_group(params, all, options);
}

std::vector<BufferLayout> build_ddp_buffers(const std::vector<ParamSpec>& params, const LayoutOptions& options) {
  check_options(options);
  std::vector<std::pair<std::pair<DType, bool>, std::vector<size_t>>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_pair(params[i].dtype, params[i].is_expert);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(i);
  }
  std::vector<BufferLayout> out;
  for (const auto& g : groups) out.push_back(layout_group(params, g.second, options));
  return out;
}

}  // namespace leanstep::layout
