// The gradient engine: one-pass norm, non-finite check, unscale and in-place
// clipping over the coalesced regions of the gradient buffers.
//
// A Plan is built once from the optimizer's list of grad views (any order,
// mixed dtypes, duplicates, sub-views, overlaps, strided views, empty views)
// and reused every step. It finds the maximal address-adjacent contiguous
// regions (padding between params is never read) and keeps a generic list for
// views that cannot join a region (with the reason). Results equal the
// per-tensor loop exactly in semantics: an element covered by k listed views
// is counted k times by norms and count_zeros and scaled k times by in-place
// ops, as the loop "for each view in list order: op(view)" would.
//
// All results are written into backend scalars (1-element tensors allocated
// by the caller); nothing is read back by the host. Results are bitwise
// identical for any thread count.
#pragma once

#include <cmath>
#include <span>
#include <type_traits>
#include <string>
#include <vector>

#include "leanstep/comm.h"
#include "leanstep/core.h"

namespace leanstep::grad {

inline constexpr double kInfNorm = INFINITY;  // norm_type for the max-abs norm

// A run of memory covered by the same listed views. `multiplicity` = how many
// listed views cover each of its elements (1 for a normal, unaliased grad).
struct Region {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  int multiplicity = 1;
  size_t nbytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
};

struct GenericView {
  size_t index = 0;  // position in the list given to the Plan
  Tensor view;
  std::string reason;
};

// A unit of parallel work: [begin, end) of one region. Fixed size, so the
// reduction tree over chunks depends only on the plan, never on threads.
struct WorkChunk {
  int32_t region = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// A generic view as the kernels see it (its reason stays with the Plan).
struct GenericRef {
  size_t index = 0;  // position in the list given to the Plan
  Tensor view;
};

// What an op receives of a Plan: plain data, pointers and counts into the
// Plan's arrays (no std::vector, no std::string), so a separately built
// backend reads it across the dispatch ABI. Valid while its Plan lives and is
// not moved. A Plan converts to it implicitly.
struct PlanView {
  const Tensor* view_data = nullptr;
  size_t view_count = 0;
  const Region* region_data = nullptr;
  size_t region_count = 0;
  const GenericRef* generic_data = nullptr;
  size_t generic_count = 0;
  const WorkChunk* chunk_data = nullptr;
  size_t chunk_count = 0;
  size_t empty_count = 0;
  size_t listed = 0;   // listed bytes
  size_t touched = 0;  // touched bytes
  bool aliases = false;
  int64_t self_overlapping = -1;  // index of the first view that may overlap itself, or -1

  std::span<const Tensor> views() const { return {view_data, view_count}; }
  std::span<const Region> regions() const { return {region_data, region_count}; }
  std::span<const GenericRef> generic() const { return {generic_data, generic_count}; }
  std::span<const WorkChunk> chunks() const { return {chunk_data, chunk_count}; }
  size_t num_tensors() const { return view_count; }
  size_t num_regions() const { return region_count; }
  size_t num_generic() const { return generic_count; }
  size_t num_empty() const { return empty_count; }
  size_t listed_bytes() const { return listed; }
  size_t touched_bytes() const { return touched; }
  bool generic_aliases() const { return aliases; }
  int64_t first_self_overlapping() const { return self_overlapping; }
};

class Plan {
 public:
  Plan() = default;
  // `grads`: the grad views (CPU, floating dtypes fp32/fp16/bf16/fp64).
  // `declared_buffers`: optional; when given every non-empty view must lie
  // inside one of them, otherwise Error.
  explicit Plan(std::span<const Tensor> grads, std::span<const Tensor> declared_buffers = {});

  size_t num_tensors() const { return views_.size(); }
  size_t num_regions() const { return regions_.size(); }
  size_t num_generic() const { return generic_.size(); }
  size_t num_empty() const { return num_empty_; }
  // Bytes of the listed views (each listed view counted once per listing).
  size_t listed_bytes() const { return listed_bytes_; }
  // Distinct bytes a fused pass touches (regions once each + generic views).
  size_t touched_bytes() const { return touched_bytes_; }
  std::string summary() const;

  const std::vector<Tensor>& views() const { return views_; }
  const std::vector<Region>& regions() const { return regions_; }
  const std::vector<GenericView>& generic() const { return generic_; }
  const std::vector<WorkChunk>& chunks() const { return chunks_; }
  // True when a generic view shares memory with another listed view (the
  // in-place ops then order their passes so the per-tensor loop is matched).
  bool generic_aliases() const { return generic_aliases_; }
  // Index of the first listed view that may overlap itself (expand(), stride
  // 0), or -1. Reads are fine; the in-place ops refuse such a plan.
  int64_t first_self_overlapping() const { return first_self_overlapping_; }

  static constexpr int64_t kChunkElements = int64_t{1} << 16;

  // The plain-data view the ops take (implicit, so ops accept a Plan).
  PlanView view() const;
  operator PlanView() const { return view(); }  // NOLINT: a Plan is usable wherever its view is

 private:
  std::vector<Tensor> views_;
  std::vector<Region> regions_;
  std::vector<GenericView> generic_;
  std::vector<GenericRef> generic_refs_;  // the same views, plain data, for PlanView
  std::vector<WorkChunk> chunks_;
  size_t num_empty_ = 0;
  size_t listed_bytes_ = 0;
  size_t touched_bytes_ = 0;
  bool generic_aliases_ = false;
  int64_t first_self_overlapping_ = -1;
};

// Error when the plan lists a view that may overlap itself (see
// Plan::first_self_overlapping), naming it: every in-place op calls it first.
void check_in_place(const PlanView& plan, std::string_view where);

// The clip threshold's rule, the one every backend applies (the Python device
// backends call it too): finite and >= 0 (0 zeroes the grads, as torch's
// clip_grad_norm_ does).
void check_max_norm(double max_norm, std::string_view where);

// The rule of a 1-element backend scalar (a norm, found_inf, a clip coefficient,
// a zero count) of `dtype`, on any device, from its metadata: the device
// backends check outputs given to them with it.
void check_scalar_arg(const Tensor& t, DType dtype, std::string_view where, std::string_view arg);

// Total norm: (sum over views of sum |x|^p)^(1/p), p = 2 (L2), kInfNorm
// (max |x|, NaN propagates) or any p > 0. Sums of p-th powers are
// accumulated in double (fp32 squares cannot overflow it), chunk partials
// combined in a fixed tree. With `comm`, the p-th power sum is SUM- (or the max
// MAX-) all-reduced before the root; every rank must call (also with an empty
// plan). Writes `out_norm` (1-element fp32). If `found_inf` (1-element fp32,
// zeroed by the caller) is given, it is set to 1 when any element is
// non-finite (on any rank), in the same pass.
void norm(const PlanView& plan, const Tensor& out_norm, double norm_type = 2.0, const Tensor* found_inf = nullptr,
          comm::Communicator* comm = nullptr);

// Fused "unscale + non-finite check + norm" in one pass: each element x
// becomes cast(float(x) * inv_scale) in place (skipped if inv_scale == 1),
// found_inf (required, 1-element fp32 zeroed by the caller) is set when an
// INPUT element is non-finite, and out_norm is the norm of the unscaled grads
// (as unscale-all-then-norm would give). `inv_scale`: 1-element fp32 tensor.
void unscale_norm(const PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm, const Tensor& found_inf,
                  double norm_type = 2.0, comm::Communicator* comm = nullptr);
void unscale_norm(const PlanView& plan, float inv_scale, const Tensor& out_norm, const Tensor& found_inf,
                  double norm_type = 2.0, comm::Communicator* comm = nullptr);

// Clip by total norm: coeff = min(1, max_norm / (norm + 1e-6)) computed from the
// stored `total_norm` (1-element fp32) without a host read, grads multiplied in
// place (always; by exactly 1 leaves fp32 bit-identical). NaN norm gives NaN
// coefficient. Writes `out_coeff` (1-element fp32) if given.
void clip(const PlanView& plan, const Tensor& total_norm, double max_norm, const Tensor* out_coeff = nullptr);

// norm then clip: the usual step. Writes out_norm (and out_coeff if given).
void norm_clip(const PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type = 2.0,
               const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr,
               comm::Communicator* comm = nullptr);

// In place grads *= scale (1-element fp32 backend scalar), computed in fp32.
void scale(const PlanView& plan, const Tensor& scale);

// Megatron's float path: Megatron-Core without Transformer Engine returns the grad
// norm as a Python float and decides the clip on the host. These keep that path's
// double arithmetic, bit for bit, with the values in backend memory (host memory:
// on the CPU the calling thread plays the device), for callers that must not read
// them back (a grad norm kept where the step left it).
//  - The norm: `out_norm` (1-element fp64) = double(`total`) ** `exponent`, as
//    Python's float power computes it (the C library's pow), `total` the
//    all-reduced fp32 sum of p-th powers (1-element) and `exponent` = 1 / p.
//  - The clip coefficient: the double max_norm / (norm + 1e-6), rounded to fp32,
//    where it is below 1; 1 otherwise (a NaN norm too: that path then scales nothing).
void float_path_norm(const Tensor& total, double exponent, const Tensor& out_norm);
float float_path_clip_coefficient(double total_norm, double max_norm);
// `out_coeff` (1-element fp32) = float_path_clip_coefficient of `total_norm`
// (1-element fp64). Returns whether the path scales (the coefficient is below 1).
bool float_path_clip_coefficient(const Tensor& total_norm, double max_norm, const Tensor& out_coeff);

// torch's clip (torch.nn.utils.clip_grad_norm_ given its norm): the coefficient
// clamp(max_norm / (total_norm + 1e-6), max=1) as torch's ops compute it on an fp32
// norm: the add (1e-6 rounded to fp32), the quotient as torch's Tensor.__rtruediv__
// makes it (the fp32 reciprocal, then a multiply by fp32(max_norm): two roundings, not
// a division's one), the clamp (a NaN stays NaN: the grads then become NaN, as torch's).
// max_norm: finite, >= 0 and at most the largest fp32.
float torch_clip_coefficient(float total_norm, double max_norm);
// `out_coeff` (1-element fp32) = torch_clip_coefficient of `total_norm` (1-element fp32).
void torch_clip_coefficient(const Tensor& total_norm, double max_norm, const Tensor& out_coeff);

// sum over views of (numel - count_nonzero) into `out_count` (1-element int64);
// SUM all-reduced with `comm`.
void count_zeros(const PlanView& plan, const Tensor& out_count, comm::Communicator* comm = nullptr);

// out[i] = cast_to(out[i].dtype, float(in[i]) * scale) for all pairs, fp32 math
// and one rounding to the destination (no overflow through a narrow
// intermediate). found_inf (1-element fp32, zeroed by the caller) is set when
// an INPUT element is non-finite. Semantics = the pairs applied in list order,
// each reading its whole input before writing (so a partially overlapping
// in/out pair gives the read-all-then-write answer). In place: out[i] == in[i].
void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, const Tensor& scale,
                        const Tensor& found_inf);
void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, float scale,
                        const Tensor& found_inf);

}  // namespace leanstep::grad

// ---------------------------------------------------------------- the reference
// The per-tensor reference path: one reduction (one dispatch) per tensor, as
// the frameworks' multi-tensor fallbacks do. It is the semantics oracle of the
// fused path and the benchmark baseline. Like those fallbacks it reads each
// tensor's partial back to the host (counted with count_host_read), but it
// keeps the partials in double (it does not round each tensor's norm).
namespace leanstep::grad::reference {

void norm(std::span<const Tensor> grads, const Tensor& out_norm, double norm_type = 2.0,
          const Tensor* found_inf = nullptr, comm::Communicator* comm = nullptr);
// For each tensor in order: unscale in place + check; then the norm of all.
void unscale_norm(std::span<const Tensor> grads, const Tensor& inv_scale, const Tensor& out_norm,
                  const Tensor& found_inf, double norm_type = 2.0, comm::Communicator* comm = nullptr);
// Reads the norm on the host (one host read), then scales tensor by tensor.
void clip(std::span<const Tensor> grads, const Tensor& total_norm, double max_norm, const Tensor* out_coeff = nullptr);
void norm_clip(std::span<const Tensor> grads, double max_norm, const Tensor& out_norm, double norm_type = 2.0,
               const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr, comm::Communicator* comm = nullptr);
void count_zeros(std::span<const Tensor> grads, const Tensor& out_count, comm::Communicator* comm = nullptr);
// Tensor by tensor in list order (a view listed twice is scaled twice), each
// value rounded once as the fused scale does (fp64 values scaled in double).
void scale(std::span<const Tensor> grads, float scale);
// Pairs in list order; each pair reads its whole input (into a temporary) before writing.
void multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, float scale, const Tensor& found_inf);

}  // namespace leanstep::grad::reference

static_assert(std::is_standard_layout_v<leanstep::grad::PlanView> && std::is_trivially_copyable_v<leanstep::grad::PlanView>,
              "a PlanView crosses the dispatch ABI as plain data");
