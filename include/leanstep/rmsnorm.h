// RMSNorm over the last dimension: fused forward/backward, a frozen-weight
// backward that skips the weight gradient, and feature delegation (which calls
// may take the frozen direct path, and why not).
//
//   r  = 1 / sqrt(mean(x^2) + eps)         per row, fp32 statistics, saved as rstd
//   g  = gamma, or 1 + gamma (zero-centered gamma)
//   y  = cast(x * r * g)                    "scale then cast" (default)
//   y  = cast(g * cast_x(x * r))            "cast then scale" (HF Llama / Qwen3)
//   dx = r * (g*dy - xhat * mean(g*dy*xhat)),  xhat = x * r
//   dgamma = sum over rows of dy * xhat     (only when asked)
//
// All outputs are caller-allocated views. Tensors must be contiguous.
#pragma once

#include <cstdint>
#include <string>

#include "leanstep/core.h"

namespace leanstep::rmsnorm {

enum class RoundingOrder : uint8_t {
  kScaleThenCast,  // y = cast(x*r*g) in fp32, one rounding (TE, torch rms_norm, Gemma, Qwen3-Next)
  kCastThenScale,  // y = g * cast_x(x*r), two roundings (HF Llama / Qwen3, apex)
};
const char* rounding_name(RoundingOrder order);  // "scale_then_cast" / "cast_then_scale"
RoundingOrder rounding_from_name(const std::string& name);

// The order in which the forward sums a row's squares (its rounding of rstd).
enum class SumOrder : uint8_t {
  kLanes,     // leanstep's: 4 accumulators of the CPU's vector width, x*x fused into the sum
  kTorchCpu,  // torch's composite rms_norm on the CPU: each square rounded to fp32, then
              // its sum's cascade over 8-lane vectors (src/rmsnorm/torch_order.cpp). With
              // the torch convention, y and rstd are torch's bit for bit where torch's sum
              // runs that order: its x86 kernels (torch 2.15 checked), rows of fewer than
              // 32768 elements or one thread (torch may split one such row between threads).
              // leanstep.torch checks each width with a probe before it relies on it.
};

struct Options {
  double eps = 1e-6;                  // must be finite and >= 0; used as fp32
  bool zero_centered_gamma = false;   // g = 1 + gamma (gamma itself is never rewritten)
  RoundingOrder rounding = RoundingOrder::kScaleThenCast;  // forward only
  SumOrder sum_order = SumOrder::kLanes;                    // forward only
};

// ---------------------------------------------------------------- kernels
//
// x: [..., H] fp32/fp16/bf16; gamma: [H] fp32/fp16/bf16; y: shape of x,
// fp32/fp16/bf16 (x's dtype or any requested one); rstd: fp32 with one element
// per row (any shape). H must be > 0; zero rows is a no-op.
// y may be exactly x (same memory and dtype) for an in-place norm; any other
// overlap between arguments is rejected.

// Obvious per-row scalar code, single thread: the oracle of semantics and the
// benchmark baseline.
void forward_reference(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                       const Options& options = {});
// Fused SIMD kernel (Highway), parallel over fixed row chunks.
void forward_fused(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                   const Options& options = {});

// dy: shape of x, fp32/fp16/bf16; rstd as saved by forward; dx: shape of x
// (x's dtype normally). dgamma: nullptr for a frozen weight (no dgamma memory is
// touched and no cross-row work is done), else a [H] fp32/fp16/bf16 output that
// is overwritten with sum_rows dy*xhat. dx may be exactly dy or x.
// The fused trainable dgamma is deterministic: per fixed row chunk partial sums
// combined by a fixed pairwise tree, independent of the thread count.
void backward_reference(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                        const Tensor& dx, const Tensor* dgamma, const Options& options = {});
void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                    const Tensor& dx, const Tensor* dgamma, const Options& options = {});
// The same with caller scratch: the trainable backward keeps its fp32 dgamma
// partial rows there when `workspace_bytes` >= backward_fused_workspace_bytes
// (else it allocates them). Results are identical either way.
void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                    const Tensor& dx, const Tensor* dgamma, const Options& options, void* workspace,
                    size_t workspace_bytes);
// Bytes of scratch the fused backward uses for x: one fp32 row of H per fixed
// chunk of rows when trainable, 0 when frozen.
size_t backward_fused_workspace_bytes(const Tensor& x, bool trainable);

// The argument rules of the kernels above (shapes, dtypes, contiguity, overlaps,
// eps, rounding) for tensors of any device, from metadata only: data addresses
// are compared, never read. The Python device backends (torch ops, Triton)
// check with these before they launch anything, so every backend refuses the
// same inputs with the same message. Errors name the Python arguments' callers
// ("rms_norm", "rms_norm_backward").
void check_forward_args(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                        const Options& options);
void check_backward_args(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                         const Tensor& dx, const Tensor* dgamma);

// ---------------------------------------------------------------- feature delegation
//
// A call describes its context. The frozen direct path is taken only when the
// weight does not require a gradient and no feature below is on; otherwise the
// general path runs. Weight, eps and gamma convention are identical on both.
struct CallContext {
  bool weight_requires_grad = true;
  bool fp8_output = false;            // output quantized to FP8 by the caller's recipe
  bool autocast = false;              // autocast changes dtypes around the op
  bool activation_offload = false;    // saved activations offloaded to host memory
  bool debug_hooks = false;           // forward/backward hooks or inspection tools attached
  bool compiled_or_captured = false;  // torch.compile / graph capture
  bool user_subclass = false;         // a user subclass overrides forward
};

enum class Path : uint8_t { kFrozenFused, kGeneral };
inline constexpr int kNumPaths = 2;
const char* path_name(Path path);  // "frozen_fused" / "general"

// Why a call took its path. kTaken means the frozen path was taken; every
// other value is a reason the frozen path was declined.
enum class Reason : uint8_t {
  kTaken,
  kWeightRequiresGrad,
  kFp8Output,
  kAutocast,
  kActivationOffload,
  kDebugHooks,
  kCompiledOrCaptured,
  kUserSubclass,
};
inline constexpr int kNumReasons = 8;
const char* reason_name(Reason reason);  // "taken", "weight_requires_grad", "fp8_output", ...

struct Decision {
  Path path = Path::kGeneral;
  Reason reason = Reason::kWeightRequiresGrad;  // the first active decline reason, or kTaken
  uint32_t decline_mask = 0;                    // bit (1 << Reason) for EVERY active decline reason
  std::string explain() const;                  // "general: weight_requires_grad, autocast"
};

// The guard: pure function of the context (usable by a dispatch registry).
Decision decide(const CallContext& context);

// The routed calls are the dispatch layer's (ops::rmsnorm_forward /
// ops::rmsnorm_backward in leanstep/ops.h): decide() is their guard, and
// `leanstep paths` counts every decision with its reasons.

}  // namespace leanstep::rmsnorm
