// The process-wide registry and the list of built-in ops.
#include "dispatch/builtin.h"
#include "leanstep/ops.h"

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
  for (const ops::OpEntry& entry : ops::op_table()) reg.add(entry.slot());
}

}  // namespace detail
}  // namespace leanstep::dispatch

namespace leanstep::ops {

// The slots: created on first use with their built-in implementations, and
// never destroyed (calls from static destructors elsewhere stay valid).
#define LEANSTEP_DEFINE_OP_SLOT(slot, Sig, name, params, args, devices) \
  dispatch::Op<Sig>& slot##_op() {                                      \
    static dispatch::Op<Sig>* const op = builtin::slot(name);           \
    return *op;                                                         \
  }
LEANSTEP_OPS(LEANSTEP_DEFINE_OP_SLOT)
#undef LEANSTEP_DEFINE_OP_SLOT

const std::array<OpEntry, kNumOps>& op_table() {
#define LEANSTEP_OP_ENTRY(slot, Sig, name, params, args, devices) \
  OpEntry{name, devices, []() -> dispatch::OpBase& { return slot##_op(); }},
  static const std::array<OpEntry, kNumOps> table = {{LEANSTEP_OPS(LEANSTEP_OP_ENTRY)}};
#undef LEANSTEP_OP_ENTRY
  return table;
}

}  // namespace leanstep::ops
