#include "core/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace leanstep::detail {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  // CPUID.(EAX=7, ECX=1):EAX bit 5. The AVX-512 state itself (XCR0) is what
  // Highway checks before it runs its AVX3 target, the only one that uses it.
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 5) & 1u;
#else
  return false;
#endif
}

std::atomic<bool> g_bf16_hardware_rounding{cpu_has_avx512_bf16()};

}  // namespace leanstep::detail
