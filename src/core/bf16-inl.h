// Per-target SIMD dtype IO (fp32 and bf16 arrays read as fp32 lanes and
// written back rounded once), shared by every Highway kernel file: the one
// place bf16 loads and stores are written.
// Include after "hwy/highway.h" in a file compiled through foreach_target.h;
// the toggle guard below re-includes this header once per target.
//
// hwy::DemoteTo(f32 -> bf16) truncates in Highway 1.0.3 (Debian 12), so bf16
// rounding is done here: round to nearest even, NaN kept as a quiet NaN (never
// turned into inf), identical to the scalar leanstep::float_to_bf16.
#if defined(LEANSTEP_CORE_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LEANSTEP_CORE_BF16_INL_H_
#undef LEANSTEP_CORE_BF16_INL_H_
#else
#define LEANSTEP_CORE_BF16_INL_H_
#endif

#include "core/cpu_features.h"
#include "hwy/highway.h"
#include "leanstep/core.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// f32 lanes -> u32 lanes holding the bf16 bits in their high half (rounded to
// nearest even; a NaN stays a quiet NaN).
template <class DF>
HWY_INLINE auto F32ToBF16High(DF, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb));
  const auto quiet_nan = hn::Or(bits, hn::Set(du, 0x00400000u));
  // IsNaN, not Ne(v, v): Highway compares are ordered, so NaN != NaN is false.
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// f32 lanes -> u32 lanes holding the bf16 bits in their low half.
template <class DF>
HWY_INLINE auto F32ToBF16Bits(DF df, hn::Vec<DF> v) {
  return hn::ShiftRight<16>(F32ToBF16High(df, v));
}

// Stores Lanes(df) f32 values as bf16 (rounded once) at dst.
template <class DF>
HWY_INLINE void StoreBF16(DF df, hn::Vec<DF> v, uint16_t* HWY_RESTRICT dst) {
  const hn::Rebind<uint16_t, DF> du16;
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(hn::RebindToSigned<DF>(), F32ToBF16Bits(df, v))), du16, dst);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// lo's then hi's 16 fp32 lanes rounded to 32 bf16 by one VCVTNE2PS2BF16 into
// *packed: round to nearest even and a quiet NaN, as F32ToBF16High, except that
// the instruction reads fp32 subnormals as zero; so false, with nothing written,
// where a lane is subnormal (the caller rounds that pair the portable way). Only
// where the CPU has AVX512_BF16 (HardwareBF16Rounding()). Inline assembly: the
// target's flags (Highway's AVX3) do not include avx512bf16.
HWY_INLINE bool HardwareRoundBF16x2(__m512 lo, __m512 hi, __m512i* packed) {
  constexpr int kSubnormal = 0x20;  // VFPCLASSPS category: denormal
  const __mmask16 subnormal =
      _mm512_kor(_mm512_fpclass_ps_mask(lo, kSubnormal), _mm512_fpclass_ps_mask(hi, kSubnormal));
  if (HWY_UNLIKELY(!_mm512_kortestz(subnormal, subnormal))) return false;
  // AT&T order: the first source fills the low half.
  asm("vcvtne2ps2bf16 %[lo], %[hi], %[out]" : [out] "=v"(*packed) : [lo] "v"(lo), [hi] "v"(hi));
  return true;
}

// 32 bf16 lanes widened to fp32 (exact) by interleaving with zero words within
// each 128-bit block: one shuffle per 16 lanes, not a zero-extension and a shift.
// The lanes then hold elements {0-3, 8-11, 16-19, 24-27} (Low) and {4-7, 12-15,
// 20-23, 28-31} (High); StoreInterleavedBF16x2 puts them back in order.
HWY_INLINE __m512 WidenBF16InterleavedLow(__m512i v) {
  return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
}
HWY_INLINE __m512 WidenBF16InterleavedHigh(__m512i v) {
  return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
}

// Stores lanes laid out as WidenBF16Interleaved{Low,High} leaves them (after
// per-lane arithmetic) as 32 bf16 in element order: HardwareRoundBF16x2, then one
// qword permute. False, with nothing stored, where HardwareRoundBF16x2 is.
HWY_INLINE bool StoreInterleavedBF16x2(__m512 lo, __m512 hi, uint16_t* HWY_RESTRICT dst) {
  __m512i packed;
  if (!HardwareRoundBF16x2(lo, hi, &packed)) return false;
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), packed));
  return true;
}
#endif

// Stores 2 * Lanes(df) f32 values, lo's then hi's, as bf16 (each rounded once, the
// same bits as two StoreBF16): the high halves of the rounded lanes gathered by one
// two-vector shuffle (ConcatOdd; one vpermt2w on AVX-512) instead of a shift, a
// narrowing and a cross-lane permute per vector. Not on HWY_SCALAR (one lane: no
// 16-bit halves to gather); callers use StoreBF16 there.
//
// `hardware`: HardwareBF16Rounding(), read by the caller once per row or call,
// not per store (a relaxed atomic load in the loop is a load and a branch per
// store that the compiler may not hoist: the stores could alias the flag).
#if HWY_TARGET != HWY_SCALAR
template <class DF>
HWY_INLINE void StoreBF16x2(DF df, hn::Vec<DF> lo, hn::Vec<DF> hi, uint16_t* HWY_RESTRICT dst,
                            [[maybe_unused]] bool hardware) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // Where the CPU has AVX512_BF16 (detail::g_bf16_hardware_rounding), one
  // VCVTNE2PS2BF16 rounds both vectors (HardwareRoundBF16x2); a pair with a
  // subnormal lane takes the code below.
  if constexpr (hn::MaxLanes(DF()) == 16) {
    __m512i packed;
    if (hardware && HardwareRoundBF16x2(lo.raw, hi.raw, &packed)) {
      _mm512_storeu_si512(dst, packed);
      return;
    }
  }
#endif
  const hn::Repartition<uint16_t, DF> d16;
  const auto odd = hn::ConcatOdd(d16, hn::BitCast(d16, F32ToBF16High(df, hi)),
                                 hn::BitCast(d16, F32ToBF16High(df, lo)));
  hn::StoreU(odd, d16, dst);
}
#endif

// Whether StoreBF16x2 may round with the CPU's VCVTNE2PS2BF16 (detail::g_bf16_hardware_rounding).
HWY_INLINE bool HardwareBF16Rounding() {
  return leanstep::detail::g_bf16_hardware_rounding.load(std::memory_order_relaxed);
}

// Loads Lanes(df) bf16 values from src, widened to f32 (exact).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadBF16(DF df, const uint16_t* HWY_RESTRICT src) {
  const hn::Rebind<uint16_t, DF> du16;
  const hn::Rebind<uint32_t, DF> du32;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src))));
}

// Lanes(df) elements i.. of a fp32 or bf16 array, as fp32 (exact).
template <DType kT, class DF>
HWY_INLINE hn::Vec<DF> LoadAsF32(DF df, const void* base, int64_t i) {
  static_assert(kT == DType::kFloat32 || kT == DType::kBFloat16);
  if constexpr (kT == DType::kFloat32) {
    return hn::LoadU(df, static_cast<const float*>(base) + i);
  } else {
    return LoadBF16(df, static_cast<const uint16_t*>(base) + i);
  }
}

// Stores fp32 lanes as elements i.. of a fp32 or bf16 array (rounded once).
template <DType kT, class DF>
HWY_INLINE void StoreFromF32(DF df, hn::Vec<DF> v, void* base, int64_t i) {
  static_assert(kT == DType::kFloat32 || kT == DType::kBFloat16);
  if constexpr (kT == DType::kFloat32) {
    hn::StoreU(v, df, static_cast<float*>(base) + i);
  } else {
    StoreBF16(df, v, static_cast<uint16_t*>(base) + i);
  }
}

}  // namespace leanstep::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // LEANSTEP_CORE_BF16_INL_H_ toggle
