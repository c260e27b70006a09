// Internal: registration of the built-in ops (one ops_<area>.cpp per area).
#pragma once

#include "leanstep/dispatch.h"

namespace leanstep::dispatch::detail {

// Adds every built-in op to `reg` (called once, by registry()).
void register_builtin_ops(Registry& reg);

// One per area (src/dispatch/ops_<area>.cpp).
void register_grad_ops(Registry& reg);
void register_rmsnorm_ops(Registry& reg);
void register_moe_ops(Registry& reg);

}  // namespace leanstep::dispatch::detail
