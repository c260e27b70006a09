// Megatron-Core style DDP gradient buffers: where each parameter's gradient
// lives in the flat, zero-initialised buffer its group shares.
//
// Reproduces Megatron-Core's _ParamAndGradBuffer placement: parameters are
// placed in REVERSE registration order; with the distributed optimizer each
// param start is rounded up to 64 elements and each bucket end to
// lcm(dp_size, 128) (or lcm(dp_size, 128, 2^16) with high-busbw padding);
// a bucket closes once it holds >= bucket_size elements. Used by the gradient
// engine's tests and benchmarks, the LoRA planner and the training step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "leanstep/core.h"

namespace leanstep::layout {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kBFloat16;  // the PARAM dtype (grads use LayoutOptions::grad_dtype)
  bool is_expert = false;           // expert-parallel params get their own buffer
  bool own_bucket = false;          // e.g. a shared embedding under the distributed optimizer
};

struct LayoutOptions {
  bool distributed_optimizer = false;   // pad param starts (64) and bucket ends (lcm)
  int dp_size = 1;                      // data-parallel world size (bucket-end padding)
  bool pad_for_high_busbw = false;      // bucket ends to lcm(dp_size, 128, 2^16)
  int64_t bucket_size = 0;              // elements per bucket; 0 = one bucket
  DType grad_dtype = DType::kFloat32;   // dtype of the flat gradient buffer
};

struct ParamSlot {
  std::string name;
  std::vector<int64_t> shape;
  size_t param_index = 0;  // position in the registration list given to the builder
  int64_t offset = 0;      // element offset of the grad in the buffer
  int64_t numel = 0;
  int bucket = 0;
};

struct BucketRange {
  int64_t begin = 0;  // element offsets [begin, end), end includes padding
  int64_t end = 0;
  int64_t numel_unpadded = 0;
};

// One flat gradient buffer.
struct BufferLayout {
  DType grad_dtype = DType::kFloat32;
  DType param_dtype = DType::kBFloat16;
  bool is_expert = false;
  std::vector<ParamSlot> params;  // in REGISTRATION order (offsets descend)
  std::vector<BucketRange> buckets;
  int64_t numel = 0;              // including padding
  int64_t numel_unpadded = 0;     // sum of param numels

  size_t nbytes() const { return static_cast<size_t>(numel) * dtype_size(grad_dtype); }
  // The grad view of params[i] over a buffer starting at `base` (shape = param shape).
  Tensor view(size_t i, void* base) const;
  // All grad views, in registration order.
  std::vector<Tensor> views(void* base) const;
  // The whole buffer as a 1-D view.
  Tensor buffer_view(void* base) const;
  std::string summary() const;
};

// Lays out one group of params (all in one buffer, whatever their dtypes).
BufferLayout build_buffer_layout(const std::vector<ParamSpec>& params, const LayoutOptions& options);

// Megatron's grouping: one buffer per (param dtype, is_expert), groups in
// order of first appearance; each buffer laid out as build_buffer_layout.
// ParamSlot::param_index refers to the full `params` list.
std::vector<BufferLayout> build_ddp_buffers(const std::vector<ParamSpec>& params,
                                            const LayoutOptions& options);

}  // namespace leanstep::layout
