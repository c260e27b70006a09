// Feature delegation: the decision between the frozen direct path and the
// general path (the guard the dispatch layer's rmsnorm ops use), and names.
#include <fmt/format.h>

#include <string>

#include "leanstep/rmsnorm.h"

namespace leanstep::rmsnorm {

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

}  // namespace leanstep::rmsnorm
