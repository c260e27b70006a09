// Planning: from any list of grad views to maximal coalesced regions.
//
// Contiguous views are sorted by address. Views whose byte ranges overlap form
// a cluster; inside a cluster (same dtype, element-aligned) the memory is cut
// at every view boundary into pieces, each with the number of listed views
// covering it (its multiplicity). Pieces are then merged into regions while
// they are address-adjacent with the same dtype and multiplicity. Padding
// between params is never covered by a view, so it is never part of a region.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>

#include "leanstep/grad.h"
#include "grad/checks.h"

namespace leanstep::grad {
namespace {

struct Candidate {
  uintptr_t begin, end;
  DType dtype;
  size_t index;
};

struct Piece {
  uintptr_t begin, end;
  DType dtype;
  int multiplicity;
};

bool inside_declared(const Tensor& t, std::span<const Tensor> declared) {
  for (const Tensor& b : declared)
    if (t.byte_begin() >= b.byte_begin() && t.byte_end() <= b.byte_end()) return true;
  return false;
}

}  // namespace

Plan::Plan(std::span<const Tensor> grads, std::span<const Tensor> declared_buffers) {
  static constexpr const char* kWhere = "grad::Plan";
  for (const Tensor& b : declared_buffers) {
    check_tensor(b, kWhere, "declared_buffers");
    check_cpu(b, kWhere, "declared_buffers");
  }
  views_.assign(grads.begin(), grads.end());
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < views_.size(); ++i) {
    const Tensor& t = views_[i];
    const std::string arg = fmt::format("grads[{}]", i);
    check_tensor(t, kWhere, arg);
    check_cpu(t, kWhere, arg);
    check_dtype(t, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}, kWhere, arg);
    listed_bytes_ += t.nbytes();
    if (t.empty()) {
      ++num_empty_;
      continue;
    }
    if (!declared_buffers.empty() && !inside_declared(t, declared_buffers))
      throw_arg_error(kWhere, arg, fmt::format("must lie inside one of the declared buffers (got {} at {:#x})",
                                               t.describe(), t.byte_begin()));
    if (first_self_overlapping_ < 0 && t.may_self_overlap()) first_self_overlapping_ = static_cast<int64_t>(i);
    if (!t.is_contiguous()) {
      generic_.push_back({i, t, "non-contiguous strides"});
    } else if (reinterpret_cast<uintptr_t>(t.data) % t.element_size() != 0) {
      generic_.push_back({i, t, "data pointer not aligned to its element size"});
    } else {
      candidates.push_back({t.byte_begin(), t.byte_end(), t.dtype, i});
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.begin != b.begin ? a.begin < b.begin : (a.end != b.end ? a.end < b.end : a.index < b.index);
  });

  // Clusters of (transitively) overlapping views -> pieces with multiplicity.
  std::vector<Piece> pieces;
  for (size_t first = 0; first < candidates.size();) {
    size_t last = first + 1;
    uintptr_t cluster_end = candidates[first].end;
    while (last < candidates.size() && candidates[last].begin < cluster_end) {
      cluster_end = std::max(cluster_end, candidates[last].end);
      ++last;
    }
    const Candidate& head = candidates[first];
    if (last == first + 1) {
      pieces.push_back({head.begin, head.end, head.dtype, 1});
      first = last;
      continue;
    }
    const char* reason = nullptr;
    const size_t esize = dtype_size(head.dtype);
    for (size_t k = first; k < last && !reason; ++k) {
      if (candidates[k].dtype != head.dtype) reason = "shares memory with a view of another dtype";
      else if ((candidates[k].begin - head.begin) % esize != 0) reason = "shares memory with a view at a misaligned offset";
    }
    if (reason) {
      for (size_t k = first; k < last; ++k) generic_.push_back({candidates[k].index, views_[candidates[k].index], reason});
      first = last;
      continue;
    }
    std::map<uintptr_t, int> delta;  // coverage change at each boundary
    for (size_t k = first; k < last; ++k) {
      ++delta[candidates[k].begin];
      --delta[candidates[k].end];
    }
    int cover = 0;
    uintptr_t at = 0;
    for (const auto& [address, change] : delta) {
      if (cover > 0 && address > at) pieces.push_back({at, address, head.dtype, cover});
      cover += change;
      at = address;
    }
    first = last;
  }

  // Merge adjacent pieces into maximal regions.
  for (const Piece& p : pieces) {
    if (!regions_.empty()) {
      Region& r = regions_.back();
      const uintptr_t r_end = reinterpret_cast<uintptr_t>(r.data) + r.nbytes();
      if (r.dtype == p.dtype && r.multiplicity == p.multiplicity && r_end == p.begin) {
        r.numel += static_cast<int64_t>((p.end - p.begin) / dtype_size(p.dtype));
        continue;
      }
    }
    regions_.push_back({reinterpret_cast<void*>(p.begin), p.dtype,
                        static_cast<int64_t>((p.end - p.begin) / dtype_size(p.dtype)), p.multiplicity});
  }
  std::sort(generic_.begin(), generic_.end(), [](const GenericView& a, const GenericView& b) { return a.index < b.index; });

  for (size_t r = 0; r < regions_.size(); ++r) {
    touched_bytes_ += regions_[r].nbytes();
    for (int64_t b = 0; b < regions_[r].numel; b += kChunkElements)
      chunks_.push_back({static_cast<int32_t>(r), b, std::min(regions_[r].numel, b + kChunkElements)});
  }
  // Does any generic view share bytes with any other listed view?
  for (const GenericView& g : generic_) {
    touched_bytes_ += g.view.nbytes();
    for (size_t j = 0; j < views_.size() && !generic_aliases_; ++j) {
      if (j == g.index || views_[j].empty()) continue;
      if (views_[j].byte_begin() < g.view.byte_end() && g.view.byte_begin() < views_[j].byte_end())
        generic_aliases_ = true;
    }
  }
  for (const GenericView& g : generic_) generic_refs_.push_back({g.index, g.view});
}

void check_in_place(const PlanView& plan, std::string_view where) {
  const int64_t i = plan.first_self_overlapping();
  if (i >= 0) check_no_self_overlap(plan.views()[static_cast<size_t>(i)], where, fmt::format("grads[{}]", i));
}

void check_max_norm(double max_norm, std::string_view where) {
  detail::check_max_norm(max_norm, std::string(where).c_str());
}

void check_scalar_arg(const Tensor& t, DType dtype, std::string_view where, std::string_view arg) {
  detail::check_scalar(t, dtype, std::string(where).c_str(), std::string(arg).c_str(), /*cpu_only=*/false);
}

PlanView Plan::view() const {
  PlanView v;
  v.view_data = views_.data();
  v.view_count = views_.size();
  v.region_data = regions_.data();
  v.region_count = regions_.size();
  v.generic_data = generic_refs_.data();
  v.generic_count = generic_refs_.size();
  v.chunk_data = chunks_.data();
  v.chunk_count = chunks_.size();
  v.empty_count = num_empty_;
  v.listed = listed_bytes_;
  v.touched = touched_bytes_;
  v.aliases = generic_aliases_;
  v.self_overlapping = first_self_overlapping_;
  return v;
}

std::string Plan::summary() const {
  std::map<DType, size_t> region_bytes;
  size_t aliased = 0;
  for (const Region& r : regions_) {
    region_bytes[r.dtype] += r.nbytes();
    if (r.multiplicity > 1) ++aliased;
  }
  std::string s = fmt::format("grad plan: {} tensors ({} empty), {:.2f} MiB listed -> {} regions, {} generic tensors\n",
                              num_tensors(), num_empty_, listed_bytes_ / 1048576.0, num_regions(), num_generic());
  for (const auto& [dtype, bytes] : region_bytes)
    s += fmt::format("  {} regions: {:.2f} MiB\n", dtype_name(dtype), bytes / 1048576.0);
  if (aliased)
    s += fmt::format("  {} regions covered by more than one listed view (counted and scaled once per listing)\n",
                     aliased);
  s += fmt::format("  {} work chunks of up to {} elements\n", chunks_.size(), kChunkElements);
  const size_t shown = std::min<size_t>(generic_.size(), 10);
  for (size_t k = 0; k < shown; ++k)
    s += fmt::format("  generic grads[{}] {}: {}\n", generic_[k].index, generic_[k].view.describe(), generic_[k].reason);
  if (generic_.size() > shown) s += fmt::format("  ... and {} more generic tensors\n", generic_.size() - shown);
  return s;
}

}  // namespace leanstep::grad
