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

// acc = (first ? +0 : acc) + src * prob. The first slot adds to +0 in registers, as
// the reference's zeroed accumulators do (the same bits, -0 products included), with
// no zeroing pass and no load of acc.
template <bool kFirst>
void AccumulateScaledT(float* HWY_RESTRICT acc, const void* src, int dtype, float prob, int64_t n) {
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto p = hn::Set(df, prob);
  const auto start = [&](int64_t i) { return kFirst ? hn::Zero(df) : hn::LoadU(df, acc + i); };
  const auto start1 = [&](int64_t i) { return kFirst ? 0.0f : acc[i]; };
  int64_t i = 0;
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: {
      const auto* s = static_cast<const float*>(src);
      for (; i + N <= n; i += N) hn::StoreU(hn::Add(start(i), hn::Mul(hn::LoadU(df, s + i), p)), df, acc + i);
      for (; i < n; ++i) acc[i] = start1(i) + s[i] * prob;
      return;
    }
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (; i + N <= n; i += N) hn::StoreU(hn::Add(start(i), hn::Mul(LoadBF16(df, s + i), p)), df, acc + i);
      for (; i < n; ++i) acc[i] = start1(i) + bf16_to_float(s[i]) * prob;
      return;
    }
    default: {  // fp16 (widened exactly either way)
      const auto* s = static_cast<const uint16_t*>(src);
#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
      const hn::Rebind<hwy::float16_t, decltype(df)> dh;
      const auto* sh = reinterpret_cast<const hwy::float16_t*>(s);
      for (; i + N <= n; i += N)
        hn::StoreU(hn::Add(start(i), hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, sh + i)), p)), df, acc + i);
#endif
      for (; i < n; ++i) acc[i] = start1(i) + half_to_float(s[i]) * prob;
      return;
    }
  }
}

void AccumulateScaled(float* HWY_RESTRICT acc, const void* src, int dtype, float prob, int64_t n, bool first) {
  if (first) AccumulateScaledT<true>(acc, src, dtype, prob, n);
  else AccumulateScaledT<false>(acc, src, dtype, prob, n);
}

// See reduce_scaled (moe/kernels.h): per vector of columns, every slot's product
// added to a register, in slot order, then one cast and store.
template <DType kT>
void ReduceScaledT(const void* const* HWY_RESTRICT srcs, const float* HWY_RESTRICT probs, int64_t count,
                   void* HWY_RESTRICT out, int64_t n) {
  using leanstep::simd::HWY_NAMESPACE::LoadAsF32;
  using leanstep::simd::HWY_NAMESPACE::StoreFromF32;
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kT == DType::kBFloat16) {  // two vectors per store (StoreBF16x2): the same bits
    const bool hardware = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
    auto block = [&](int64_t at) {
      auto lo = hn::Zero(df), hi = hn::Zero(df);
      for (int64_t s = 0; s < count; ++s) {
        const auto p = hn::Set(df, probs[s]);
        lo = hn::Add(lo, hn::Mul(LoadAsF32<kT>(df, srcs[s], at), p));
        hi = hn::Add(hi, hn::Mul(LoadAsF32<kT>(df, srcs[s], at + N), p));
      }
      leanstep::simd::HWY_NAMESPACE::StoreBF16x2(df, lo, hi, static_cast<uint16_t*>(out) + at, hardware);
    };
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    if (N == 16 && hardware) {
      // AVX-512 with VCVTNE2PS2BF16: each lane's arithmetic as in `block`, on lanes
      // widened by interleaving (WidenBF16Interleaved{Low,High}), stored back in order
      // by StoreInterleavedBF16x2. A block with a subnormal sum (which the instruction
      // reads as zero) goes through `block`.
      using leanstep::simd::HWY_NAMESPACE::StoreInterleavedBF16x2;
      using leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedHigh;
      using leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedLow;
      for (; i + 2 * N <= n; i += 2 * N) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        for (int64_t s = 0; s < count; ++s) {
          const __m512 p = _mm512_set1_ps(probs[s]);
          const __m512i v = _mm512_loadu_si512(static_cast<const uint16_t*>(srcs[s]) + i);
          lo = _mm512_add_ps(lo, _mm512_mul_ps(WidenBF16InterleavedLow(v), p));
          hi = _mm512_add_ps(hi, _mm512_mul_ps(WidenBF16InterleavedHigh(v), p));
        }
        if (HWY_UNLIKELY(!StoreInterleavedBF16x2(lo, hi, static_cast<uint16_t*>(out) + i))) block(i);
      }
    }
#endif
    for (; i + 2 * N <= n; i += 2 * N) block(i);
  }
#endif
  for (; i + N <= n; i += N) {
    auto acc = hn::Zero(df);
    for (int64_t s = 0; s < count; ++s)
      acc = hn::Add(acc, hn::Mul(LoadAsF32<kT>(df, srcs[s], i), hn::Set(df, probs[s])));
    StoreFromF32<kT>(df, acc, out, i);
  }
  for (; i < n; ++i) {  // the tail, element by element: the same operations
    float acc = 0.0f;
    for (int64_t s = 0; s < count; ++s) {
      const float x = kT == DType::kFloat32 ? static_cast<const float*>(srcs[s])[i]
                                            : bf16_to_float(static_cast<const uint16_t*>(srcs[s])[i]);
      acc = acc + x * probs[s];
    }
    if constexpr (kT == DType::kFloat32) static_cast<float*>(out)[i] = acc;
    else static_cast<uint16_t*>(out)[i] = float_to_bf16(acc);
  }
}

void ReduceScaled(const void* const* srcs, const float* probs, int64_t count, int dtype, void* out, int64_t n) {
  if (static_cast<DType>(dtype) == DType::kBFloat16) ReduceScaledT<DType::kBFloat16>(srcs, probs, count, out, n);
  else ReduceScaledT<DType::kFloat32>(srcs, probs, count, out, n);
}

#if HWY_TARGET != HWY_SCALAR
// Whether every product a[h] * b[h], h < end, whose fp32 exponent field is zero (a
// zero, subnormal or underflowed product) has a zero factor, so is an exact +-0.
template <DType kT, class DFW>
HWY_NOINLINE bool ZeroProductsHaveZeroFactors(DFW dfw, const void* a, const void* b, int64_t end) {
  using leanstep::simd::HWY_NAMESPACE::LoadAsF32;
  const hn::RebindToUnsigned<DFW> du;
  const auto exponent = hn::Set(du, 0x7F800000u);
  const auto zero = hn::Zero(dfw);
  const int64_t W = static_cast<int64_t>(hn::Lanes(dfw));
  for (int64_t h = 0; h < end; h += W) {
    const auto va = LoadAsF32<kT>(dfw, a, h), vb = LoadAsF32<kT>(dfw, b, h);
    const auto field = hn::And(hn::BitCast(du, hn::Mul(va, vb)), exponent);
    const auto no_exponent = hn::RebindMask(dfw, hn::Eq(field, hn::Zero(du)));
    const auto zero_factor = hn::Or(hn::Eq(va, zero), hn::Eq(vb, zero));
    if (!hn::AllFalse(dfw, hn::AndNot(zero_factor, no_exponent))) return false;
  }
  return true;
}
#endif

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The AVX-512 steps of the bf16 dot (DotF64T) and of its fused twin (ScaleRowDotT):
// 32 elements a step, the same partial sums in the same order as DotF64T's loops,
// with fewer instructions (perf: this dot was most of a small unpermute backward).
// - bf16 is widened by WidenBF16Interleaved{Low,High} (core/bf16-inl.h): the lanes
//   then hold elements {0-3, 8-11, 16-19, 24-27} (lo) and {4-7, 12-15, 20-23, 28-31} (hi);
// - so lo's lower 8 products go to partials {0-3, 8-11} and its upper 8, 16 elements
//   later, to the same partials: one fp64 accumulator per half-set (sums_lo, sums_hi);
// - each product's exactness is read by one VFPCLASSPS (zero, subnormal, infinite or
//   NaN: every category but a negative finite); a row with any such product takes
//   DotF64T's portable loop from its start, which tells the exact zeros (a zero
//   factor) from the rest.
struct Bf16DotAvx512 {
  __m512d sums_lo, sums_hi;
  __mmask16 unusual;

  // (Not a constructor: an implicit one is not compiled for the target.)
  HWY_INLINE void Start() {
    sums_lo = _mm512_setzero_pd();
    sums_hi = _mm512_setzero_pd();
    unusual = 0;
  }

  // Elements h..h+31 of a and b, as raw bf16 vectors.
  HWY_INLINE void Step(__m512i va, __m512i vb) {
    constexpr int kUnusual = 0xBF;
    using leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedHigh;
    using leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedLow;
    const __m512 lo = _mm512_mul_ps(WidenBF16InterleavedLow(va), WidenBF16InterleavedLow(vb));
    const __m512 hi = _mm512_mul_ps(WidenBF16InterleavedHigh(va), WidenBF16InterleavedHigh(vb));
    unusual = static_cast<__mmask16>(unusual | _mm512_fpclass_ps_mask(lo, kUnusual) | _mm512_fpclass_ps_mask(hi, kUnusual));
    sums_lo = _mm512_add_pd(sums_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(lo)));
    sums_hi = _mm512_add_pd(sums_hi, _mm512_cvtps_pd(_mm512_castps512_ps256(hi)));
    sums_lo = _mm512_add_pd(sums_lo, _mm512_cvtps_pd(_mm512_extractf32x8_ps(lo, 1)));
    sums_hi = _mm512_add_pd(sums_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(hi, 1)));
  }

  // DotF64T's layout: partials 0-7 and 8-15.
  HWY_INLINE __m512d Partials0to7() const {
    return _mm512_permutex2var_pd(sums_lo, _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), sums_hi);
  }
  HWY_INLINE __m512d Partials8to15() const {
    return _mm512_permutex2var_pd(sums_lo, _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15), sums_hi);
  }

  // dot_f64_tree in registers, ((p0 + p1) + (p2 + p3)) + ... (an fp add is
  // commutative, so any operand order gives the tree's bits).
  HWY_INLINE double Tree() const {
    // Level 1, s_i = p[2i] + p[2i+1]: lanes [s0, s2, s1, s3, s4, s6, s5, s7].
    const __m512d pairs = _mm512_add_pd(_mm512_unpacklo_pd(sums_lo, sums_hi), _mm512_unpackhi_pd(sums_lo, sums_hi));
    // Level 2, t_i = s[2i] + s[2i+1]: lanes [t0, t1, ., ., t2, t3, ., .].
    const __m512d quads = _mm512_add_pd(pairs, _mm512_shuffle_f64x2(pairs, pairs, 0xB1));
    const __m128d t01 = _mm512_castpd512_pd128(quads), t23 = _mm512_extractf64x2_pd(quads, 2);
    // Levels 3 and 4: (t0 + t1) + (t2 + t3).
    const double u0 = _mm_cvtsd_f64(t01) + _mm_cvtsd_f64(_mm_unpackhi_pd(t01, t01));
    const double u1 = _mm_cvtsd_f64(t23) + _mm_cvtsd_f64(_mm_unpackhi_pd(t23, t23));
    return u0 + u1;
  }
};
#endif

// The sum of a[h] * b[h] in double, in a fixed order whatever the SIMD width: 16
// partial sums, partial[j] over h = j (mod 16) in increasing h, then a fixed
// pairwise tree (dot_f64_reference in moe/kernels.h, the same order in plain C++).
// Each fp32 product is exact in double, so a fused multiply-add rounds as the add
// alone. Vectors of up to 16 lanes hold the partial sums (2 on AVX-512, 4 on AVX2,
// 8 on SSE4 and NEON), so the bits do not depend on the target.
template <DType kT>
double DotF64T(const void* a, const void* b, int64_t n) {
#if HWY_HAVE_SCALABLE  // lanes known only at run time: the plain order (no speed needed there)
  return dot_f64_reference(a, b, kT, n);
#else
  using leanstep::simd::HWY_NAMESPACE::LoadAsF32;
  const hn::CappedTag<double, kDotPartials> dd;
  const hn::Rebind<float, decltype(dd)> df;
  constexpr size_t L = hn::MaxLanes(dd);
  constexpr size_t K = kDotPartials / L;
  hn::Vec<decltype(dd)> acc[K];
  for (size_t k = 0; k < K; ++k) acc[k] = hn::Zero(dd);
  int64_t h = 0;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kT == DType::kBFloat16 && L == 8 && K == 2) {  // see Bf16DotAvx512
    const auto* pa = static_cast<const uint16_t*>(a);
    const auto* pb = static_cast<const uint16_t*>(b);
    Bf16DotAvx512 dot;
    dot.Start();
    for (; h + 2 * static_cast<int64_t>(kDotPartials) <= n; h += 2 * kDotPartials)
      dot.Step(_mm512_loadu_si512(pa + h), _mm512_loadu_si512(pb + h));
    if (dot.unusual) {
      h = 0;  // the loop below, from the start
    } else if (h == n) {
      return dot.Tree();  // no tail
    } else {
      acc[0].raw = dot.Partials0to7();
      acc[1].raw = dot.Partials8to15();
    }
  }
#endif
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kT == DType::kBFloat16 && K % 2 == 0) {
    // A product of two bf16 values (8-bit significands) is exact in fp32 unless it
    // overflows or leaves fp32's normal range: multiply full fp32 vectors, then widen
    // the products, half a vector to each partial sum. Where every product is exact,
    // each add rounds as the fused multiply-add of the widened inputs does, so the
    // bits are those of the plain order, with half the loads and conversions. The
    // products' exponent fields say whether every one was exact: all ones (an
    // infinity or a NaN) sends the row to the plain order; a zero field (a zero,
    // subnormal or underflowed product) does unless every such product has a zero
    // factor (then it is an exact +-0: a zero gradient row keeps the fast sums).
    const hn::Twice<decltype(df)> dfw;
    const hn::RebindToUnsigned<decltype(dfw)> du;
    const auto exponent = hn::Set(du, 0x7F800000u);
    auto lowest = exponent, highest = hn::Zero(du);
    for (; h + static_cast<int64_t>(kDotPartials) <= n; h += kDotPartials)
      for (size_t k = 0; k < K; k += 2) {
        const int64_t at = h + static_cast<int64_t>(k * L);
        const auto product = hn::Mul(LoadAsF32<kT>(dfw, a, at), LoadAsF32<kT>(dfw, b, at));
        const auto field = hn::And(hn::BitCast(du, product), exponent);
        lowest = hn::Min(lowest, field);
        highest = hn::Max(highest, field);
        acc[k] = hn::Add(acc[k], hn::PromoteTo(dd, hn::LowerHalf(df, product)));
        acc[k + 1] = hn::Add(acc[k + 1], hn::PromoteTo(dd, hn::UpperHalf(df, product)));
      }
    if (h > 0 && (hn::GetLane(hn::MaxOfLanes(du, highest)) == 0x7F800000u ||
                  (hn::GetLane(hn::MinOfLanes(du, lowest)) == 0 && !ZeroProductsHaveZeroFactors<kT>(dfw, a, b, h)))) {
      for (size_t k = 0; k < K; ++k) acc[k] = hn::Zero(dd);
      h = 0;
    }
  }
#endif
  for (; h + static_cast<int64_t>(kDotPartials) <= n; h += kDotPartials)
    for (size_t k = 0; k < K; ++k) {
      const int64_t at = h + static_cast<int64_t>(k * L);
      acc[k] = hn::MulAdd(hn::PromoteTo(dd, LoadAsF32<kT>(df, a, at)), hn::PromoteTo(dd, LoadAsF32<kT>(df, b, at)),
                          acc[k]);
    }
  HWY_ALIGN double partial[kDotPartials];
  for (size_t k = 0; k < K; ++k) hn::Store(acc[k], dd, partial + k * L);
  if (h == n) return dot_f64_tree(partial);  // no tail (H a multiple of 16): no call
  return dot_f64_finish(partial, a, b, kT, h, n);
#endif
}

// out = cast(dy * prob) for one fp32 or bf16 row; with `dot`, also returns the sum
// of dy[h] * x[h] in double (each fp32 product exact in double; the partial sums
// per double lane, added in a fixed tree: the order depends on the row's length
// and the SIMD target only).
template <DType kT>
double ScaleRowDotT(const void* dy, const void* x, float prob, void* out, int64_t n, bool dot) {
  using leanstep::simd::HWY_NAMESPACE::LoadAsF32;
  using leanstep::simd::HWY_NAMESPACE::StoreFromF32;
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vp = hn::Set(df, prob);
  int64_t i = 0;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kT == DType::kBFloat16) {
    if (dot && N == 16 && n % (2 * static_cast<int64_t>(kDotPartials)) == 0 &&
        leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding()) {
      // One pass: dy read once for the scaled row and the dot (Bf16DotAvx512). The
      // scaled lanes are the loops' below (dy * prob, rounded once by VCVTNE2PS2BF16),
      // on the interleave's lanes, put back in order by one qword permute; a block
      // with a subnormal product (which the instruction reads as zero) is stored the
      // portable way.
      const auto* pdy = static_cast<const uint16_t*>(dy);
      const auto* px = static_cast<const uint16_t*>(x);
      auto* po = static_cast<uint16_t*>(out);
      const __m512 p = _mm512_set1_ps(prob);
      Bf16DotAvx512 sums;
      sums.Start();
      for (int64_t h = 0; h < n; h += 2 * N) {
        const __m512i vdy = _mm512_loadu_si512(pdy + h);
        sums.Step(vdy, _mm512_loadu_si512(px + h));
        const __m512 lo = _mm512_mul_ps(leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedLow(vdy), p);
        const __m512 hi = _mm512_mul_ps(leanstep::simd::HWY_NAMESPACE::WidenBF16InterleavedHigh(vdy), p);
        if (HWY_UNLIKELY(!leanstep::simd::HWY_NAMESPACE::StoreInterleavedBF16x2(lo, hi, po + h)))
          leanstep::simd::HWY_NAMESPACE::StoreBF16x2(df, hn::Mul(LoadAsF32<kT>(df, dy, h), vp),
                                                     hn::Mul(LoadAsF32<kT>(df, dy, h + N), vp), po + h, true);
      }
      if (!sums.unusual) return sums.Tree();
      return DotF64T<kT>(dy, x, n);  // an inexact product: the dot the portable way
    }
  }
#endif
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kT == DType::kBFloat16) {  // two vectors per store: the same bits
    const bool hardware = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
    for (; i + 2 * N <= n; i += 2 * N)
      leanstep::simd::HWY_NAMESPACE::StoreBF16x2(df, hn::Mul(LoadAsF32<kT>(df, dy, i), vp),
                                                 hn::Mul(LoadAsF32<kT>(df, dy, i + N), vp),
                                                 static_cast<uint16_t*>(out) + i, hardware);
  }
#endif
  for (; i + N <= n; i += N) StoreFromF32<kT>(df, hn::Mul(LoadAsF32<kT>(df, dy, i), vp), out, i);
  if (i < n) {  // the tail through the same vector code, zero-padded
    HWY_ALIGN float tdy[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN float tout[HWY_MAX_BYTES / sizeof(float)] = {};
    convert_to_f32(static_cast<const char*>(dy) + i * dtype_size(kT), kT, tdy, n - i);
    hn::Store(hn::Mul(hn::Load(df, tdy), vp), df, tout);
    convert_from_f32(tout, static_cast<char*>(out) + i * dtype_size(kT), kT, n - i);
  }
  if (!dot) return 0.0;
  return DotF64T<kT>(dy, x, n);
}

double ScaleRowDot(const void* dy, const void* x, int dtype, float prob, void* out, int64_t n, bool dot) {
  return static_cast<DType>(dtype) == DType::kBFloat16
             ? ScaleRowDotT<DType::kBFloat16>(dy, x, prob, out, n, dot)
             : ScaleRowDotT<DType::kFloat32>(dy, x, prob, out, n, dot);
}

}  // namespace leanstep::moe::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace leanstep::moe::detail {
HWY_EXPORT(AccumulateScaled);
HWY_EXPORT(ScaleRowDot);
HWY_EXPORT(ReduceScaled);

void reduce_scaled(const void* const* srcs, const float* probs, int64_t count, DType dtype, void* out, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(ReduceScaled)(srcs, probs, count, static_cast<int>(dtype), out, n);
}

double scale_row_dot(const void* dy, const void* x, DType dtype, float prob, void* out, int64_t n, bool dot) {
  if (n <= 0) return 0.0;
  return HWY_DYNAMIC_DISPATCH(ScaleRowDot)(dy, x, static_cast<int>(dtype), prob, out, n, dot);
}

void accumulate_scaled(float* acc, const void* src, DType dtype, float prob, int64_t n, bool first) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(AccumulateScaled)(acc, src, static_cast<int>(dtype), prob, n, first);
}
}  // namespace leanstep::moe::detail
#endif
