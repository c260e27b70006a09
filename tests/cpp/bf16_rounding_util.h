// Tests' switch of the AVX-512 kernels' hardware bf16 rounding
// (src/core/cpu_features.h).
#pragma once

#include "core/cpu_features.h"

namespace leanstep::testing {

// Switches the AVX-512 kernels' hardware bf16 rounding for one scope.
class HardwareBF16Rounding {
 public:
  explicit HardwareBF16Rounding(bool on) : was_(leanstep::detail::g_bf16_hardware_rounding.exchange(on)) {}
  ~HardwareBF16Rounding() { leanstep::detail::g_bf16_hardware_rounding.store(was_); }

 private:
  bool was_;
};

}  // namespace leanstep::testing
