// Argument checks shared by the MoE entry points. Each throws leanstep::Error
// naming the function, the argument and the rule it broke.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "leanstep/core.h"
#include "moe/common.h"

namespace leanstep::moe::detail {

// `host`: the CPU kernels' own check (host memory). false: the device backends'
// check on metadata (moe::check_*_args): any device, addresses compared, never read.

// A CPU, contiguous tensor with `ndim` dims.
void check_rows(const Tensor& t, const char* where, const char* name, int ndim, bool host = true);
// A bool [T, E] routing map with E >= 1.
void check_map(const Tensor& t, const char* where, const char* name, bool host = true);
// A CPU, contiguous output of exactly this dtype and shape.
void check_out(const Tensor& t, const char* where, const char* name, DType dtype,
               std::initializer_list<int64_t> shape, bool host = true);
// An int64/int32 [n] index vector; int32 only when every value up to `max_value` fits.
IndexView check_indices(const Tensor& t, const char* where, const char* name, int64_t n, int64_t max_value,
                        bool host = true);
// sorted_indices values in [-1, T).
void check_index_values(const IndexView& indices, int64_t n, int64_t T, const char* where);
// `out` must share no byte with any non-null, non-empty input.
void check_no_overlap(const Tensor& out, std::initializer_list<const Tensor*> inputs, const char* where,
                      const char* name);

// The rules of slot_experts / slot_probs that need no values: the map's form,
// n = E * capacity with drop_and_pad; probs' dtype and shape ([N], or [T, E] with
// routing_map).
void check_slot_experts_args(const char* where, int64_t n, const Tensor& routing_map, bool drop_and_pad,
                             bool host = true);
void check_slot_probs_args(const char* where, int64_t n, int64_t T, const Tensor* probs, const Tensor* routing_map,
                           bool drop_and_pad, bool host = true);
// Expert of every slot: drop_and_pad: i / (N / E); plain path: experts own consecutive
// segments of their routed counts in routing_map, slots beyond the routed count have
// no expert (-1) and must have no source token (index -1).
std::vector<int64_t> slot_experts(const char* where, const IndexView& indices, int64_t n, const Tensor& routing_map,
                                  bool drop_and_pad);
// Per-slot probs as float (empty when probs is null): probs [N] (routing_map null) or
// probs [T, E] read at (sorted_indices[i], expert of slot i). `experts`: slot_experts of
// the same arguments where the caller has it (else computed here).
std::vector<float> slot_probs(const char* where, const IndexView& indices, int64_t n, int64_t T, const Tensor* probs,
                              const Tensor* routing_map, bool drop_and_pad,
                              const std::vector<int64_t>* experts = nullptr);

}  // namespace leanstep::moe::detail
