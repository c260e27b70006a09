// The process-wide registry and the list of built-in ops.
#include "dispatch/builtin.h"

namespace leanstep::dispatch {

Registry& registry() {
  // Never destroyed: ops may be called (and counted) from static destructors of
  // other translation units.
  static Registry* reg = [] {
    auto* r = new Registry();
    detail::register_builtin_ops(*r);
    return r;
  }();
  return *reg;
}

namespace detail {

void register_builtin_ops(Registry& reg) {
  register_grad_ops(reg);
  register_rmsnorm_ops(reg);
  register_moe_ops(reg);
}

}  // namespace detail
}  // namespace leanstep::dispatch
