// CPU features the SIMD kernels read at run time, beyond the Highway target
// (Highway 1.0.3, Debian 12's, has no target for them).
#pragma once

#include <atomic>

namespace leanstep::detail {

// Whether the CPU converts fp32 to bf16 itself (AVX512_BF16: VCVTNE2PS2BF16,
// round to nearest even, NaN kept quiet, as leanstep's own rounding).
bool cpu_has_avx512_bf16();

// Whether the AVX-512 kernels store bf16 with that instruction: on where the
// CPU has it. Its one difference, fp32 subnormals read as zero, is taken
// care of where it is used (such vectors take the portable rounding), so
// both settings give the same bits; tests switch it off to compare them.
extern std::atomic<bool> g_bf16_hardware_rounding;

}  // namespace leanstep::detail
