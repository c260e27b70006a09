#include "moe/kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/moe/kernels_simd.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "src/core/bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::moe::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using leanstep::simd::HWY_NAMESPACE::LoadBF16;

void AccumulateScaled(float* HWY_RESTRICT acc, const void* src, int dtype, float prob, int64_t n) {
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto p = hn::Set(df, prob);
  int64_t i = 0;
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: {
      const auto* s = static_cast<const float*>(src);
      for (; i + N <= n; i += N)
        hn::StoreU(hn::Add(hn::LoadU(df, acc + i), hn::Mul(hn::LoadU(df, s + i), p)), df, acc + i);
      for (; i < n; ++i) acc[i] += s[i] * prob;
      return;
    }
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (; i + N <= n; i += N)
        hn::StoreU(hn::Add(hn::LoadU(df, acc + i), hn::Mul(LoadBF16(df, s + i), p)), df, acc + i);
      for (; i < n; ++i) acc[i] += bf16_to_float(s[i]) * prob;
      return;
    }
    default: {  // fp16 (widened exactly either way)
      const auto* s = static_cast<const uint16_t*>(src);
#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
      const hn::Rebind<hwy::float16_t, decltype(df)> dh;
      const auto* sh = reinterpret_cast<const hwy::float16_t*>(s);
      for (; i + N <= n; i += N)
        hn::StoreU(hn::Add(hn::LoadU(df, acc + i), hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, sh + i)), p)), df, acc + i);
#endif
      for (; i < n; ++i) acc[i] += half_to_float(s[i]) * prob;
      return;
    }
  }
}

}  // namespace leanstep::moe::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace leanstep::moe::detail {
HWY_EXPORT(AccumulateScaled);

void accumulate_scaled(float* acc, const void* src, DType dtype, float prob, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(AccumulateScaled)(acc, src, static_cast<int>(dtype), prob, n);
}
}  // namespace leanstep::moe::detail
#endif
