// Feature delegation: the guard that decides between the frozen direct path
// and the general path, the routed entry points, and the per-path counters.
#include <fmt/format.h>

#include <atomic>
#include <string>

#include "leanstep/rmsnorm.h"

namespace leanstep::rmsnorm {
namespace {

struct AtomicStats {
  std::atomic<uint64_t> forward_calls[kNumPaths] = {};
  std::atomic<uint64_t> backward_calls[kNumPaths] = {};
  std::atomic<uint64_t> declines[kNumReasons] = {};
};
AtomicStats& stats() {
  static AtomicStats s;
  return s;
}

void record(const Decision& d, bool is_forward) {
  auto& s = stats();
  (is_forward ? s.forward_calls : s.backward_calls)[static_cast<int>(d.path)].fetch_add(1, std::memory_order_relaxed);
  for (int r = 0; r < kNumReasons; ++r)
    if (d.decline_mask & (1u << r)) s.declines[r].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

const char* rounding_name(RoundingOrder order) {
  return order == RoundingOrder::kCastThenScale ? "cast_then_scale" : "scale_then_cast";
}

RoundingOrder rounding_from_name(const std::string& name) {
  if (name == "scale_then_cast") return RoundingOrder::kScaleThenCast;
  if (name == "cast_then_scale") return RoundingOrder::kCastThenScale;
  throw_arg_error("rmsnorm::rounding_from_name", "name",
                  fmt::format("must be scale_then_cast or cast_then_scale (got '{}')", name));
}

const char* path_name(Path path) { return path == Path::kFrozenFused ? "frozen_fused" : "general"; }

const char* reason_name(Reason reason) {
  switch (reason) {
    case Reason::kTaken: return "taken";
    case Reason::kWeightRequiresGrad: return "weight_requires_grad";
    case Reason::kFp8Output: return "fp8_output";
    case Reason::kAutocast: return "autocast";
    case Reason::kActivationOffload: return "activation_offload";
    case Reason::kDebugHooks: return "debug_hooks";
    case Reason::kCompiledOrCaptured: return "compiled_or_captured";
    case Reason::kUserSubclass: return "user_subclass";
  }
  return "unknown";
}

Decision decide(const CallContext& c) {
  const std::pair<bool, Reason> checks[] = {
      {c.weight_requires_grad, Reason::kWeightRequiresGrad}, {c.fp8_output, Reason::kFp8Output},
      {c.autocast, Reason::kAutocast},                       {c.activation_offload, Reason::kActivationOffload},
      {c.debug_hooks, Reason::kDebugHooks},                  {c.compiled_or_captured, Reason::kCompiledOrCaptured},
      {c.user_subclass, Reason::kUserSubclass},
  };
  Decision d;
  d.path = Path::kFrozenFused;
  d.reason = Reason::kTaken;
  for (const auto& [active, reason] : checks) {
    if (!active) continue;
    if (d.decline_mask == 0) d.reason = reason;
    d.decline_mask |= 1u << static_cast<int>(reason);
    d.path = Path::kGeneral;
  }
  return d;
}

std::string Decision::explain() const {
  if (path == Path::kFrozenFused) return "frozen_fused: weight frozen and no delegated feature on";
  std::string s = "general:";
  for (int r = 1; r < kNumReasons; ++r)
    if (decline_mask & (1u << r)) s += fmt::format("{} {}", s.back() == ':' ? "" : ",", reason_name(static_cast<Reason>(r)));
  return s;
}

Decision forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                 const Options& options, const CallContext& context) {
  const Decision d = decide(context);
  // Both paths run the same fused forward: the forward does not depend on
  // whether the weight is trainable, and results must be identical.
  forward_fused(x, gamma, y, rstd, options);
  record(d, true);
  return d;
}

Decision backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                  const Tensor& dx, const Tensor* dgamma, const Options& options, const CallContext& context) {
  const char* where = "rmsnorm::backward";
  if (context.weight_requires_grad)
    LEANSTEP_CHECK_ARG(dgamma != nullptr, where, "dgamma", "must be given when the weight requires grad");
  else
    LEANSTEP_CHECK_ARG(dgamma == nullptr, where, "dgamma",
                       "must be null when the weight is frozen (context.weight_requires_grad is false)");
  const Decision d = decide(context);
  if (d.path == Path::kFrozenFused) backward_fused(dy, x, rstd, gamma, dx, nullptr, options);
  else backward_fused(dy, x, rstd, gamma, dx, dgamma, options);  // trainable kernel iff dgamma given
  record(d, false);
  return d;
}

PathStats path_stats() {
  PathStats p;
  auto& s = stats();
  for (int i = 0; i < kNumPaths; ++i) {
    p.forward_calls[i] = s.forward_calls[i].load(std::memory_order_relaxed);
    p.backward_calls[i] = s.backward_calls[i].load(std::memory_order_relaxed);
  }
  for (int r = 0; r < kNumReasons; ++r) p.declines[r] = s.declines[r].load(std::memory_order_relaxed);
  return p;
}

void reset_path_stats() {
  auto& s = stats();
  for (auto& v : s.forward_calls) v.store(0, std::memory_order_relaxed);
  for (auto& v : s.backward_calls) v.store(0, std::memory_order_relaxed);
  for (auto& v : s.declines) v.store(0, std::memory_order_relaxed);
}

std::string PathStats::describe() const {
  std::string s;
  for (int p = 0; p < kNumPaths; ++p)
    s += fmt::format("{:<13} forward {:>8}  backward {:>8}\n", path_name(static_cast<Path>(p)), forward_calls[p],
                     backward_calls[p]);
  bool any = false;
  for (int r = 1; r < kNumReasons; ++r) {
    if (!declines[r]) continue;
    s += fmt::format("{}{} {}", any ? ", " : "declined by: ", reason_name(static_cast<Reason>(r)), declines[r]);
    any = true;
  }
  if (any) s += "\n";
  return s;
}

}  // namespace leanstep::rmsnorm
