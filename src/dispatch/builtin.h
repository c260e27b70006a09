// Internal: the built-in implementations of every op, and their registration.
#pragma once

#include "leanstep/dispatch.h"
#include "leanstep/ops.h"

namespace leanstep::ops::builtin {

// One per row of the op table (leanstep/ops.h), defined in ops_<area>.cpp beside
// the adapters: the slot named `name` with its reference and its built-in fast
// implementations installed. Called once, when the slot is first used.
#define LEANSTEP_DECLARE_BUILTIN(slot, Sig, text, params, args, devices) dispatch::Op<Sig>* slot(const char* name);
LEANSTEP_OPS(LEANSTEP_DECLARE_BUILTIN)
#undef LEANSTEP_DECLARE_BUILTIN

}  // namespace leanstep::ops::builtin

namespace leanstep::dispatch::detail {

// Adds every op of the table to `reg` (called once, by registry()).
void register_builtin_ops(Registry& reg);

}  // namespace leanstep::dispatch::detail
