// leanstep MoE: top-k routing with capacity, token permutation to expert-major
// order and back, their backward, routing-map padding and chunk sorting.
//
// Conventions (see docs/moe.md for the full semantics):
// - T tokens, E experts, H hidden. routing_map is bool [T, E]; probs are [T, E].
// - Every output is a caller-allocated, contiguous view; the size helpers below
//   say how big it must be. Optional inputs/outputs are pointers (nullptr = absent).
// - Permuted order is EXPERT-MAJOR and, within an expert, INCREASING TOKEN index:
//   exactly the order of a stable sort of the transposed 0/1 map (Megatron-Core's
//   masked_select / stable argsort order).
// - sorted_indices: int64 (the default, what the frameworks use) or int32 (when
//   T < 2^31); -1 marks an output row with no source token (see num_out_tokens).
// - All index arithmetic is 64-bit.
// - Two implementations of every data-moving op, selected explicitly:
//   Method::kSort (the reference: stable sort of FP32 keys of the transposed
//   mask, serial loops) and Method::kFused (counting sort / prefix sums,
//   parallel, deterministic). Their outputs are bit-identical for every input.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "leanstep/core.h"

namespace leanstep::moe {

// ---------------------------------------------------------------- methods

enum class Method : uint8_t { kSort, kFused };
Method method_from_name(std::string_view name);  // "sort" | "fused"; Error otherwise
const char* method_name(Method method);

// ---------------------------------------------------------------- routing

enum class ScoreFunction : uint8_t { kSoftmax, kSigmoid };
enum class DropPolicy : uint8_t { kProbs, kPosition };
ScoreFunction score_function_from_name(std::string_view name);  // "softmax" | "sigmoid"
DropPolicy drop_policy_from_name(std::string_view name);        // "probs" | "position"

struct RoutingConfig {
  int64_t topk = 2;                         // 1 <= topk <= E
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool pre_softmax = false;                 // softmax: over all E before top-k (else over the k chosen)
  // Divide the k chosen probs by (their sum + 1e-20). nullopt = the framework default:
  // sigmoid with topk > 1 normalises; softmax does not (post-top-k softmax already sums to 1).
  std::optional<bool> normalize;
  std::optional<double> scaling_factor;     // multiplies the final probs
  std::optional<double> capacity_factor;    // enables capacity dropping; must be > 0
  DropPolicy drop_policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;             // with capacity: every expert gets exactly `capacity` slots
};

// capacity = ceil(T * topk / E * capacity_factor) (Megatron's get_capacity of T*topk tokens).
int64_t expert_capacity(int64_t num_tokens, int64_t num_experts, int64_t topk, double capacity_factor);

// logits: fp32/fp16/bf16 [T, E]. expert_bias: fp32 [E] or nullptr (sigmoid only: chooses
// top-k on sigmoid+bias, probs use the unbiased sigmoid).
// Outputs: routing_map bool [T, E]; probs fp32 [T, E] (0 where not routed);
// tokens_per_expert int64 [E] = routed tokens per expert BEFORE capacity dropping.
// All arithmetic in fp32; ties in top-k go to the lower expert index, in "probs"
// dropping to the lower token index; NaN ranks above every number (as torch.topk).
void route(const Tensor& logits, const RoutingConfig& config, const Tensor* expert_bias,
           const Tensor& routing_map, const Tensor& probs, const Tensor& tokens_per_expert);

// ---------------------------------------------------------------- permute

// Number of routed (token, expert) pairs in a bool [T, E] map (a full read of the map).
int64_t count_routed(const Tensor& routing_map);

// Rows of permute's outputs (permuted, permuted_probs, sorted_indices):
// - plain path: num_out_tokens if given (must be >= the routed count: checked by permute),
//   else the routed count (reads the map);
// - drop_and_pad: num_out_tokens (required; a multiple of E, capacity = num_out_tokens / E <= T).
int64_t permute_output_rows(const Tensor& routing_map, std::optional<int64_t> num_out_tokens,
                            bool drop_and_pad);

// permuted[i] = tokens[sorted_indices[i]] (a bit-exact gather); permuted_probs[i] =
// probs[token, expert] of slot i (same dtype as probs).
// Plain path: slots are the routed pairs in expert-major, increasing-token order. If
// num_out_tokens exceeds the routed count, the extra rows are zero, prob 0, index -1;
// if it is smaller, Error (never an out-of-bounds write).
// drop_and_pad: capacity = num_out_tokens / E; per expert, routed tokens in token order, then
// unrouted tokens in token order (padding), the first `capacity` kept.
// tokens: float [T, H]; routing_map: bool [T, E]; probs: float [T, E] or nullptr;
// permuted: tokens' dtype [N, H]; permuted_probs: probs' dtype [N] (given iff probs is);
// sorted_indices: int64 or int32 [N].
void permute(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
             std::optional<int64_t> num_out_tokens, bool drop_and_pad, Method method,
             const Tensor& permuted, const Tensor* permuted_probs, const Tensor& sorted_indices);

// ---------------------------------------------------------------- rules on metadata
// The argument rules of permute, unpermute and their backwards that need no tensor
// values (shapes, dtypes, contiguity, overlaps, num_out_tokens, E * capacity with
// drop_and_pad), for tensors of any device: data addresses are compared, never read.
// The Python device backends (torch ops, Triton) check with these before they launch
// anything, so every backend refuses the same inputs with the same message; the rules
// on values (index ranges, the routed count) they check on the device. permute without
// num_out_tokens (plain path): the row count is the routed count, a value, so the
// outputs' own row count is taken.
void check_permute_args(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                        std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                        const Tensor* permuted_probs, const Tensor& sorted_indices);
void check_unpermute_args(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                          const Tensor* probs, const Tensor* routing_map, bool drop_and_pad);
void check_permute_backward_args(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens);
void check_permute_probs_backward_args(const Tensor& dpermuted_probs, const Tensor& sorted_indices,
                                       const Tensor& routing_map, bool drop_and_pad, const Tensor& dprobs);
// pad_routing_map's and sort_chunks_by_idxs' (split sizes and order: dtypes and shapes;
// their values on the device).
void check_pad_routing_map_args(const Tensor& routing_map, int64_t multiple, const Tensor& out);
void check_sort_chunks_by_idxs_args(const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs,
                                    const Tensor& out, const Tensor* probs, const Tensor* out_probs);
void check_unpermute_backward_args(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                                   const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                                   const Tensor& dpermuted, const Tensor* dprobs);

// ---------------------------------------------------------------- unpermute

// out[t] = sum over slots i with sorted_indices[i] == t, in increasing i, of
// float(permuted[i]) * prob_i, accumulated in fp32 from +0 and cast once to out's dtype.
// Rows with index -1 are skipped; tokens with no slot come back as zeros.
// probs (optional), either
//   - [N] permuted probs (routing_map == nullptr), or
//   - [T, E] with routing_map [T, E] (Megatron's form): slot i's prob is
//     probs[sorted_indices[i], expert of slot i]; plain path: N must equal the routed count
//     and experts own consecutive segments of their routed counts; drop_and_pad: N = E * capacity,
//     slot i belongs to expert i / capacity.
// permuted: float [N, H]; out: permuted's dtype [T, H] (restore_shape is out's shape).
void unpermute(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
               const Tensor* probs, const Tensor* routing_map, bool drop_and_pad, Method method);

// ---------------------------------------------------------------- backward

// Backward of permute w.r.t. tokens: dtokens = unpermute(dpermuted) without probs.
void permute_backward(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens,
                      Method method);

// Backward of permute w.r.t. probs: dprobs [T, E] is zero except dprobs[t_i, e_i] +=
// dpermuted_probs[i] for every slot with a source token (slot experts as in unpermute).
void permute_probs_backward(const Tensor& dpermuted_probs, const Tensor& sorted_indices,
                            const Tensor& routing_map, bool drop_and_pad, const Tensor& dprobs);

// Backward of unpermute: dpermuted[i] = cast(float(dout[t_i]) * prob_i) (zero for index -1);
// dprobs (if probs given): d prob_i = sum_h dout[t_i, h] * permuted[i, h], accumulated in
// float64 in increasing h and stored in probs' dtype; shaped like probs ([N], or [T, E]
// zero except at the slots' (token, expert) entries).
void unpermute_backward(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                        const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                        Method method, const Tensor& dpermuted, const Tensor* dprobs);

// ---------------------------------------------------------------- padding, chunks

// Returns in `out` (bool [T, E]) a copy of routing_map where each expert's routed count is
// padded up to a multiple of `multiple` by switching on its first unrouted tokens in token
// order (an expert with too few unrouted tokens stays short). Does NOT mutate routing_map
// unless `out` is the same memory (allowed; partial overlap is an Error).
void pad_routing_map(const Tensor& routing_map, int64_t multiple, const Tensor& out);

// Splits rows [R, ...] into consecutive chunks of split_sizes (int64/int32 [C]) and writes
// them to out in the order sorted_idxs (int64/int32 [C], a permutation of 0..C-1). Rows beyond
// sum(split_sizes) keep their place. probs/out_probs (optional, [R, ...]) move the same way.
void sort_chunks_by_idxs(const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs,
                         const Tensor& out, const Tensor* probs = nullptr,
                         const Tensor* out_probs = nullptr);

}  // namespace leanstep::moe
