// Bulk dtype conversions with Google Highway (dynamic dispatch to the best
// SIMD target of the running CPU). bf16 rounding is done here rather than with
// hwy::DemoteTo, which truncates in the Highway version Debian 12 ships.
#include <cstring>

#include "leanstep/core.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/core/convert.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "src/core/bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using leanstep::simd::HWY_NAMESPACE::LoadBF16;  // src/core/bf16-inl.h
using leanstep::simd::HWY_NAMESPACE::StoreBF16;

void ToF32(const void* src, int dtype, float* HWY_RESTRICT dst, int64_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  int64_t i = 0;
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (; i + static_cast<int64_t>(N) <= n; i += N) hn::StoreU(LoadBF16(df, s + i), df, dst + i);
      for (; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
    case DType::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
      const hn::Rebind<hwy::float16_t, decltype(df)> dh;
      const auto* sh = reinterpret_cast<const hwy::float16_t*>(s);
      for (; i + static_cast<int64_t>(N) <= n; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, sh + i)), df, dst + i);
#endif
      for (; i < n; ++i) dst[i] = half_to_float(s[i]);
      return;
    }
    default:
      for (; i < n; ++i) dst[i] = static_cast<float>(load_as_double(src, static_cast<DType>(dtype), i));
  }
}

void FromF32(const float* HWY_RESTRICT src, void* dst, int dtype, int64_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  int64_t i = 0;
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
#if HWY_TARGET != HWY_SCALAR
      const bool hardware = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
      for (; i + 2 * static_cast<int64_t>(N) <= n; i += 2 * N)
        leanstep::simd::HWY_NAMESPACE::StoreBF16x2(df, hn::LoadU(df, src + i), hn::LoadU(df, src + i + N), d + i,
                                                   hardware);
#endif
      for (; i + static_cast<int64_t>(N) <= n; i += N) StoreBF16(df, hn::LoadU(df, src + i), d + i);
      for (; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
      // F16C conversion: round to nearest even, overflow to inf, NaN kept.
      const hn::Rebind<hwy::float16_t, decltype(df)> dh;
      auto* dhp = reinterpret_cast<hwy::float16_t*>(d);
      for (; i + static_cast<int64_t>(N) <= n; i += N) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + i)), dh, dhp + i);
#endif
      for (; i < n; ++i) d[i] = float_to_half(src[i]);
      return;
    }
    default:
      for (; i < n; ++i) store_from_double(dst, static_cast<DType>(dtype), i, src[i]);
  }
}

}  // namespace leanstep::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace leanstep {
HWY_EXPORT(ToF32);
HWY_EXPORT(FromF32);

void convert_to_f32(const void* src, DType src_dtype, float* dst, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(ToF32)(src, static_cast<int>(src_dtype), dst, n);
}
void convert_from_f32(const float* src, void* dst, DType dst_dtype, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(FromF32)(src, dst, static_cast<int>(dst_dtype), n);
}
}  // namespace leanstep
#endif
