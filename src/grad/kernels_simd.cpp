// SIMD run kernel of the gradient engine (Google Highway, dynamic dispatch).
// One pass over a contiguous run: optional in-place scale, non-finite check of
// the inputs, and the L2 / L1 / inf norm partial of the (scaled) values.
// Squares and |x| are accumulated in double lanes (each fp32 lane promoted),
// so no fp32 square can overflow and sums of millions of terms stay exact to
// ~1e-16 relative. Lanes are combined in a fixed order: deterministic.
#include <cmath>
#include <cstring>

#include "grad/kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/grad/kernels_simd.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "src/core/bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::grad::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR

using leanstep::simd::HWY_NAMESPACE::LoadBF16;  // src/core/bf16-inl.h: the dtype IO
using leanstep::simd::HWY_NAMESPACE::StoreBF16;

// Element access per dtype: load N lanes as fp32, store fp32 lanes rounded once.
struct F32Io {
  using T = float;
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) { return hn::LoadU(df, p); }
  template <class DF>
  static HWY_INLINE void Store(DF df, hn::Vec<DF> v, T* p) { hn::StoreU(v, df, p); }
  static float ToF(T x) { return x; }
  static T FromF(float x) { return x; }
  static constexpr bool kNarrow = false;
};

struct BF16Io {
  using T = uint16_t;
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) { return LoadBF16(df, p); }  // src/core/bf16-inl.h
  template <class DF>
  static HWY_INLINE void Store(DF df, hn::Vec<DF> v, T* p) { StoreBF16(df, v, p); }
  static float ToF(T x) { return bf16_to_float(x); }
  static T FromF(float x) { return float_to_bf16(x); }
  static constexpr bool kNarrow = true;
};

#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
#define LEANSTEP_GRAD_HAVE_F16 1
// F16C conversions: round to nearest even, overflow to inf, NaN kept.
struct F16Io {
  using T = uint16_t;
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
  }
  template <class DF>
  static HWY_INLINE void Store(DF df, hn::Vec<DF> v, T* p) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    hn::StoreU(hn::DemoteTo(dh, v), dh, reinterpret_cast<hwy::float16_t*>(p));
  }
  static float ToF(T x) { return half_to_float(x); }
  static T FromF(float x) { return float_to_half(x); }
  static constexpr bool kNarrow = true;
};
#else
#define LEANSTEP_GRAD_HAVE_F16 0
#endif

template <class Io, int kKind, bool kScale>
void Run(typename Io::T* HWY_RESTRICT p, int64_t n, float scale, Partial& out) {
  const hn::ScalableTag<float> df;
  const hn::Half<decltype(df)> dfh;
  const hn::Repartition<double, decltype(df)> dd;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vscale = hn::Set(df, scale);
  const auto zero = hn::Zero(df);
  auto sum0 = hn::Zero(dd), sum1 = hn::Zero(dd);
  auto vmax = zero, nan_seen = zero, nonfinite = zero;
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = Io::Load(df, p + i);
    nonfinite = hn::MulAdd(v, zero, nonfinite);  // inf * 0 and NaN * 0 are NaN
    if constexpr (kScale) {
      v = hn::Mul(v, vscale);
      Io::Store(df, v, p + i);
      if constexpr (Io::kNarrow) v = Io::Load(df, p + i);  // the norm sees the stored (rounded) value
    }
    if constexpr (kKind == static_cast<int>(NormKind::kL2)) {
      const auto lo = hn::PromoteTo(dd, hn::LowerHalf(dfh, v));
      const auto hi = hn::PromoteTo(dd, hn::UpperHalf(dfh, v));
      sum0 = hn::MulAdd(lo, lo, sum0);
      sum1 = hn::MulAdd(hi, hi, sum1);
    } else if constexpr (kKind == static_cast<int>(NormKind::kL1)) {
      const auto a = hn::Abs(v);
      sum0 = hn::Add(sum0, hn::PromoteTo(dd, hn::LowerHalf(dfh, a)));
      sum1 = hn::Add(sum1, hn::PromoteTo(dd, hn::UpperHalf(dfh, a)));
    } else if constexpr (kKind == static_cast<int>(NormKind::kInf)) {
      // NaN lanes are tracked apart (x86 max would drop them) and excluded from the
      // max. IsNaN, not Ne(v, v): Highway compares ordered, so NaN != NaN is false.
      const auto is_nan = hn::IsNaN(v);
      nan_seen = hn::Or(nan_seen, hn::VecFromMask(df, is_nan));
      vmax = hn::Max(vmax, hn::IfThenZeroElse(is_nan, hn::Abs(v)));
    }
  }
  double sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(sum0, sum1)));
  float mx = hn::GetLane(hn::MaxOfLanes(df, vmax));
  bool nan = !hn::AllTrue(df, hn::Eq(nan_seen, zero));
  bool nf = std::isnan(hn::GetLane(hn::SumOfLanes(df, nonfinite)));
  for (; i < n; ++i) {  // tail: the same per-element operations
    float v = Io::ToF(p[i]);
    if (!std::isfinite(v)) nf = true;
    if constexpr (kScale) {
      p[i] = Io::FromF(v * scale);
      v = Io::ToF(p[i]);
    }
    if constexpr (kKind == static_cast<int>(NormKind::kL2)) {
      sum += static_cast<double>(v) * v;
    } else if constexpr (kKind == static_cast<int>(NormKind::kL1)) {
      sum += std::fabs(static_cast<double>(v));
    } else if constexpr (kKind == static_cast<int>(NormKind::kInf)) {
      if (std::isnan(v)) nan = true;
      else if (std::fabs(v) > mx) mx = std::fabs(v);
    }
  }
  out.sum += sum;
  out.max = mx > out.max ? mx : out.max;
  out.nan = out.nan || nan;
  out.nonfinite = out.nonfinite || nf;
}

template <class Io>
bool DispatchKind(void* data, int64_t n, int kind, bool do_scale, float scale, Partial& out) {
  auto* p = static_cast<typename Io::T*>(data);
#define LEANSTEP_GRAD_CASE(K)                                              \
  case static_cast<int>(K):                                                \
    if (do_scale) Run<Io, static_cast<int>(K), true>(p, n, scale, out);    \
    else Run<Io, static_cast<int>(K), false>(p, n, scale, out);            \
    return true;
  switch (kind) {
    LEANSTEP_GRAD_CASE(NormKind::kNone)
    LEANSTEP_GRAD_CASE(NormKind::kL2)
    LEANSTEP_GRAD_CASE(NormKind::kL1)
    LEANSTEP_GRAD_CASE(NormKind::kInf)
    default: return false;
  }
#undef LEANSTEP_GRAD_CASE
}

bool ReduceScaleRun(void* data, int dtype, int64_t n, int kind, bool do_scale, float scale, Partial* out) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: return DispatchKind<F32Io>(data, n, kind, do_scale, scale, *out);
    case DType::kBFloat16: return DispatchKind<BF16Io>(data, n, kind, do_scale, scale, *out);
#if LEANSTEP_GRAD_HAVE_F16
    case DType::kFloat16: return DispatchKind<F16Io>(data, n, kind, do_scale, scale, *out);
#endif
    default: return false;
  }
}
#undef LEANSTEP_GRAD_HAVE_F16

#else  // HWY_SCALAR: the scalar path in kernels_scalar.cpp does the work.
bool ReduceScaleRun(void*, int, int64_t, int, bool, float, Partial*) { return false; }
#endif

}  // namespace leanstep::grad::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace leanstep::grad::detail {
HWY_EXPORT(ReduceScaleRun);

bool simd_reduce_scale_run(void* data, DType dtype, int64_t n, NormKind kind, bool do_scale, float scale,
                           Partial& out) {
  return HWY_DYNAMIC_DISPATCH(ReduceScaleRun)(data, static_cast<int>(dtype), n, static_cast<int>(kind), do_scale,
                                              scale, &out);
}
}  // namespace leanstep::grad::detail
#endif
