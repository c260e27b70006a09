// Internal: registration of the built-in ops (one ops_<area>.cpp per area).
#pragma once

#include "leanstep/dispatch.h"

namespace leanstep::dispatch::detail {

// Adds every op of the table (leanstep/ops.h) to `reg` (called once, by registry()).
void register_builtin_ops(Registry& reg);

}  // namespace leanstep::dispatch::detail
