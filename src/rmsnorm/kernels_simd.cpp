// The RMSNorm row kernels in Highway SIMD, compiled for every target and
// dispatched to the best one of the running CPU (src/rmsnorm/kernels.h); the
// fused path (fused.cpp) drives them over fixed row chunks in parallel.
//
// fp32 and bf16 rows are loaded and stored in their own dtype (widened/rounded
// in registers, src/core/bf16-inl.h). Statistics are accumulated in fp32 in 4
// independent vector accumulators. Row tails are run through the same vector
// code on a zero-padded copy, so every element of a row sees exactly the same
// arithmetic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "leanstep/rmsnorm.h"
#include "rmsnorm/kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/rmsnorm/kernels_simd.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "src/core/bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::rmsnorm::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kPad = HWY_MAX_BYTES / sizeof(float);  // room for one vector of any target

// ---- typed loads/stores: rows are read and written in their storage dtype
// (fp32 or bf16) and widened in registers; all arithmetic is fp32.

template <DType kT, class DF>
HWY_INLINE hn::Vec<DF> LoadF32(DF df, const void* base, int64_t i) {
  return leanstep::simd::HWY_NAMESPACE::LoadAsF32<kT>(df, base, i);  // src/core/bf16-inl.h
}

template <DType kT, class DF>
HWY_INLINE void StoreF32(DF df, hn::Vec<DF> v, void* base, int64_t i) {
  leanstep::simd::HWY_NAMESPACE::StoreFromF32<kT>(df, v, base, i);
}

// Row tails: the last n < lanes elements go through the same vector code on a
// zero-padded fp32 copy, so every element sees exactly the same arithmetic.
template <DType kT>
HWY_INLINE void TailToF32(const void* base, int64_t i, int64_t n, float* padded) {
  for (int64_t k = 0; k < n; ++k)
    padded[k] = kT == DType::kFloat32 ? static_cast<const float*>(base)[i + k]
                                      : bf16_to_float(static_cast<const uint16_t*>(base)[i + k]);
}
template <DType kT>
HWY_INLINE void TailFromF32(const float* padded, void* base, int64_t i, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    if constexpr (kT == DType::kFloat32) static_cast<float*>(base)[i + k] = padded[k];
    else static_cast<uint16_t*>(base)[i + k] = float_to_bf16(padded[k]);
  }
}

// The row kernels are inlined into the chunk loops (ForwardRowsT, BackwardRowsT):
// a row of 256 is 8 to 16 vector steps, and a call per row with its frame and
// constants cost about as much as a fifth of the row (perf, bf16 forward).

// sum of x[i]^2, in 4 independent accumulators
template <DType kT>
HWY_INLINE float SumSquaresT(const void* x, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    const auto v0 = LoadF32<kT>(d, x, i), v1 = LoadF32<kT>(d, x, i + N);
    const auto v2 = LoadF32<kT>(d, x, i + 2 * N), v3 = LoadF32<kT>(d, x, i + 3 * N);
    a0 = hn::MulAdd(v0, v0, a0);
    a1 = hn::MulAdd(v1, v1, a1);
    a2 = hn::MulAdd(v2, v2, a2);
    a3 = hn::MulAdd(v3, v3, a3);
  }
  for (; i + N <= n; i += N) {
    const auto v = LoadF32<kT>(d, x, i);
    a0 = hn::MulAdd(v, v, a0);
  }
  if (i < n) {
    HWY_ALIGN float tail[kPad] = {};
    TailToF32<kT>(x, i, n - i, tail);
    const auto v = hn::Load(d, tail);
    a1 = hn::MulAdd(v, v, a1);
  }
  const auto total = hn::Add(hn::Add(a0, a1), hn::Add(a2, a3));
  return hn::GetLane(hn::SumOfLanes(d, total));
}

// Stores value(k), for the whole vectors k of a row of n elements, as kT: bf16 in
// pairs of vectors (StoreBF16x2: the same bits as one at a time) while two remain,
// then single vectors. Returns where the whole vectors end (the tail is the
// caller's). `value` reads only: the order of its calls does not matter.
template <DType kT, class D, class Value>
HWY_INLINE int64_t StoreRowVectorsT(D d, int64_t n, const Value& value, void* out,
                                    [[maybe_unused]] bool hardware_bf16) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kT == DType::kBFloat16) {
    for (; i + 2 * N <= n; i += 2 * N)
      leanstep::simd::HWY_NAMESPACE::StoreBF16x2(d, value(i), value(i + N), static_cast<uint16_t*>(out) + i,
                                                 hardware_bf16);
  }
#endif
  for (; i + N <= n; i += N) StoreF32<kT>(d, value(i), out, i);
  return i;
}

// y = cast((x * r) * g)   (scale then cast: one rounding to y's dtype)
template <DType kT>
HWY_INLINE void ScaleRowT(const void* x, float r, const float* HWY_RESTRICT g, void* y, int64_t n,
                          bool hardware_bf16) {
  const hn::ScalableTag<float> d;
  const auto vr = hn::Set(d, r);
  auto at = [&](int64_t k) { return hn::Mul(hn::Mul(LoadF32<kT>(d, x, k), vr), hn::LoadU(d, g + k)); };
  const int64_t i = StoreRowVectorsT<kT>(d, n, at, y, hardware_bf16);
  if (i < n) {
    HWY_ALIGN float tx[kPad] = {}, tg[kPad] = {}, ty[kPad];
    TailToF32<kT>(x, i, n - i, tx);
    std::memcpy(tg, g + i, static_cast<size_t>(n - i) * sizeof(float));
    hn::Store(hn::Mul(hn::Mul(hn::Load(d, tx), vr), hn::Load(d, tg)), d, ty);
    TailFromF32<kT>(ty, y, i, n - i);
  }
}

// sum of (g*dy) * (x*r); with kAccumulate also partial += dy*xhat (the
// trainable backward's dgamma partial, accumulated in the pass that streams dy
// and x from memory: the dx pass then is the frozen one, from cache). With
// kKeepProducts, each g*dy and x*r also goes to gdy_row and xhat_row (aligned, n
// elements; n a multiple of 2 * Lanes: no tail), for CachedBackwardRowT.
template <DType kT, bool kAccumulate, bool kKeepProducts = false>
HWY_INLINE float GdyXhatDotT(const float* HWY_RESTRICT g, const void* dy, const void* x, float r,
                             float* HWY_RESTRICT partial, int64_t n, float* HWY_RESTRICT gdy_row = nullptr,
                             float* HWY_RESTRICT xhat_row = nullptr) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vr = hn::Set(d, r);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  // One vector's term; pp: its partial (kAccumulate only); k: where its products are kept.
  auto step = [&](auto vg, auto vdy, auto vx, float* pp, [[maybe_unused]] int64_t k) {
    const auto xhat = hn::Mul(vx, vr);
    const auto gdy = hn::Mul(vg, vdy);
    if constexpr (kAccumulate) hn::StoreU(hn::MulAdd(vdy, xhat, hn::LoadU(d, pp)), d, pp);
    if constexpr (kKeepProducts) {
      hn::Store(gdy, d, gdy_row + k);
      hn::Store(xhat, d, xhat_row + k);
    }
    return hn::Mul(gdy, xhat);
  };
  auto at = [&](int64_t k) {
    return step(hn::LoadU(d, g + k), LoadF32<kT>(d, dy, k), LoadF32<kT>(d, x, k), kAccumulate ? partial + k : nullptr,
                k);
  };
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, at(i));
    a1 = hn::Add(a1, at(i + N));
    a2 = hn::Add(a2, at(i + 2 * N));
    a3 = hn::Add(a3, at(i + 3 * N));
  }
  for (; i + N <= n; i += N) a0 = hn::Add(a0, at(i));
  if constexpr (!kKeepProducts) {
    if (i < n) {
      HWY_ALIGN float tg[kPad] = {}, tdy[kPad] = {}, tx[kPad] = {}, tp[kPad] = {};
      const size_t bytes = static_cast<size_t>(n - i) * sizeof(float);
      std::memcpy(tg, g + i, bytes);
      TailToF32<kT>(dy, i, n - i, tdy);
      TailToF32<kT>(x, i, n - i, tx);
      if constexpr (kAccumulate) std::memcpy(tp, partial + i, bytes);
      a1 = hn::Add(a1, step(hn::Load(d, tg), hn::Load(d, tdy), hn::Load(d, tx), tp, 0));
      if constexpr (kAccumulate) std::memcpy(partial + i, tp, bytes);
    }
  }
  const auto total = hn::Add(hn::Add(a0, a1), hn::Add(a2, a3));
  return hn::GetLane(hn::SumOfLanes(d, total));
}

// dx = r * (g*dy - xhat*m), xhat = x*r. The frozen and trainable backward
// both run it (the trainable one's dgamma partial is taken in the dot pass),
// so their dx is bitwise equal.
template <DType kT>
HWY_INLINE void DxRowT(const float* HWY_RESTRICT g, const void* dy, const void* x, float r, float m, void* dx,
                       int64_t n, bool hardware_bf16) {
  const hn::ScalableTag<float> d;
  const auto vr = hn::Set(d, r);
  const auto vm = hn::Set(d, m);
  auto step = [&](auto vg, auto vdy, auto vx) {
    const auto xhat = hn::Mul(vx, vr);
    return hn::Mul(vr, hn::NegMulAdd(xhat, vm, hn::Mul(vg, vdy)));
  };
  auto at = [&](int64_t k) { return step(hn::LoadU(d, g + k), LoadF32<kT>(d, dy, k), LoadF32<kT>(d, x, k)); };
  const int64_t i = StoreRowVectorsT<kT>(d, n, at, dx, hardware_bf16);
  if (i < n) {
    HWY_ALIGN float tg[kPad] = {}, tdy[kPad] = {}, tx[kPad] = {}, tdx[kPad];
    std::memcpy(tg, g + i, static_cast<size_t>(n - i) * sizeof(float));
    TailToF32<kT>(dy, i, n - i, tdy);
    TailToF32<kT>(x, i, n - i, tx);
    hn::Store(step(hn::Load(d, tg), hn::Load(d, tdy), hn::Load(d, tx)), d, tdx);
    TailFromF32<kT>(tdx, dx, i, n - i);
  }
}

// Whole chunks of rows in one call, for the direct (fp32 / bf16) paths: the
// row loop runs inside the target's code, so a short row (the hidden sizes of
// small models, 256) pays no per-row indirect calls or constant set-up. Each
// row sees exactly the arithmetic of the row kernels above.
template <DType kT>
void ForwardRowsT(const void* x, const float* HWY_RESTRICT g, void* y, float* HWY_RESTRICT rstd, float eps,
                  int64_t rows, int64_t n) {
  const size_t row_bytes = static_cast<size_t>(n) * dtype_size(kT);
  // Rows go in L1 blocks (detail::l1_block_rows): the statistics of the whole block
  // first (independent dependency chains, each ending in a reduction, a divide and a
  // square root, that overlap), then the scaling, from cache.
  const int64_t block_rows = detail::l1_block_rows(static_cast<int64_t>(row_bytes));
  float r[detail::kMaxBlockRows];
  const bool hardware_bf16 = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
  for (int64_t begin = 0; begin < rows; begin += block_rows) {
    const int64_t count = std::min(block_rows, rows - begin);
    const char* xb = static_cast<const char*>(x) + static_cast<size_t>(begin) * row_bytes;
    for (int64_t k = 0; k < count; ++k)
      r[k] = detail::inv_rms(SumSquaresT<kT>(xb + static_cast<size_t>(k) * row_bytes, n), n, eps);
    char* yb = static_cast<char*>(y) + static_cast<size_t>(begin) * row_bytes;
    for (int64_t k = 0; k < count; ++k) {
      if (rstd) rstd[begin + k] = r[k];
      ScaleRowT<kT>(xb + static_cast<size_t>(k) * row_bytes, r[k], g, yb + static_cast<size_t>(k) * row_bytes, n,
                    hardware_bf16);
    }
  }
}

// The second pass of ForwardRowsT alone, each row with its given rstd.
template <DType kT>
void ScaleRowsT(const void* x, const float* HWY_RESTRICT g, void* y, const float* HWY_RESTRICT rstd, int64_t rows,
                int64_t n) {
  const size_t row_bytes = static_cast<size_t>(n) * dtype_size(kT);
  const bool hardware_bf16 = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
  for (int64_t row = 0; row < rows; ++row) {
    const size_t at = static_cast<size_t>(row) * row_bytes;
    ScaleRowT<kT>(static_cast<const char*>(x) + at, rstd[row], g, static_cast<char*>(y) + at, n, hardware_bf16);
  }
}

// Rows of up to this many elements keep the dot pass's g*dy and x*r in fp32 scratch
// rows (2 x 8 KiB, in L1 with the row itself): the dx pass then reads them instead
// of widening dy and x again and redoing both products. The values are the ones
// GdyXhatDotT and DxRowT compute (the same operations), so dx has the same bits.
constexpr int64_t kCachedRowElements = 2048;

// One row's dot (and dgamma partial) and dx, g*dy and x*r computed once. n: a
// multiple of 2 * Lanes (no tail; see BackwardRowsT).
template <DType kT, bool kAccumulate>
HWY_INLINE void CachedBackwardRowT(const float* HWY_RESTRICT g, const void* dy, const void* x, float r,
                                   float* HWY_RESTRICT partial, void* dx, int64_t n, float* HWY_RESTRICT gdy_row,
                                   float* HWY_RESTRICT xhat_row, bool hardware_bf16) {
  const hn::ScalableTag<float> d;
  const auto vr = hn::Set(d, r);
  const float dot = GdyXhatDotT<kT, kAccumulate, true>(g, dy, x, r, partial, n, gdy_row, xhat_row);
  const auto vm = hn::Set(d, detail::row_mean(dot, n));
  // DxRowT's step on the kept products.
  auto dx_at = [&](int64_t k) {
    return hn::Mul(vr, hn::NegMulAdd(hn::Load(d, xhat_row + k), vm, hn::Load(d, gdy_row + k)));
  };
  StoreRowVectorsT<kT>(d, n, dx_at, dx, hardware_bf16);  // no tail: n is whole vector pairs
}

// dx of whole chunks of rows; `partial`: the dgamma partial of the chunk (trainable), or null.
template <DType kT>
void BackwardRowsT(const float* HWY_RESTRICT g, const void* dy, const void* x, const float* HWY_RESTRICT rstd,
                   float* HWY_RESTRICT partial, void* dx, int64_t rows, int64_t n) {
  const size_t row_bytes = static_cast<size_t>(n) * dtype_size(kT);
  const bool hardware_bf16 = leanstep::simd::HWY_NAMESPACE::HardwareBF16Rounding();
  const hn::ScalableTag<float> d;
  const int64_t step = 2 * static_cast<int64_t>(hn::Lanes(d));
  if (n <= kCachedRowElements && n % step == 0) {
    HWY_ALIGN float gdy_row[kCachedRowElements];
    HWY_ALIGN float xhat_row[kCachedRowElements];
    for (int64_t row = 0; row < rows; ++row) {
      const size_t at = static_cast<size_t>(row) * row_bytes;
      const void* dyr = static_cast<const char*>(dy) + at;
      const void* xr = static_cast<const char*>(x) + at;
      void* dxr = static_cast<char*>(dx) + at;
      if (partial)
        CachedBackwardRowT<kT, true>(g, dyr, xr, rstd[row], partial, dxr, n, gdy_row, xhat_row, hardware_bf16);
      else
        CachedBackwardRowT<kT, false>(g, dyr, xr, rstd[row], nullptr, dxr, n, gdy_row, xhat_row, hardware_bf16);
    }
    return;
  }
  for (int64_t row = 0; row < rows; ++row) {
    const size_t at = static_cast<size_t>(row) * row_bytes;
    const void* dyr = static_cast<const char*>(dy) + at;
    const void* xr = static_cast<const char*>(x) + at;
    const float r = rstd[row];
    const float dot = partial ? GdyXhatDotT<kT, true>(g, dyr, xr, r, partial, n)
                              : GdyXhatDotT<kT, false>(g, dyr, xr, r, nullptr, n);
    DxRowT<kT>(g, dyr, xr, r, detail::row_mean(dot, n), static_cast<char*>(dx) + at, n, hardware_bf16);
  }
}

// Exported instantiations: fp32 rows one at a time (the scratch path's widened
// rows), and whole chunks of fp32 or bf16 rows read and written directly.
float SumSquaresF32(const void* x, int64_t n) { return SumSquaresT<DType::kFloat32>(x, n); }
void ScaleRowF32(const void* x, float r, const float* g, void* y, int64_t n) {
  ScaleRowT<DType::kFloat32>(x, r, g, y, n, false);  // fp32 rows: no bf16 stores
}
float GdyXhatDotF32(const float* g, const void* dy, const void* x, float r, int64_t n) {
  return GdyXhatDotT<DType::kFloat32, false>(g, dy, x, r, nullptr, n);
}
float GdyXhatDotAccumulateF32(const float* g, const void* dy, const void* x, float r, float* p, int64_t n) {
  return GdyXhatDotT<DType::kFloat32, true>(g, dy, x, r, p, n);
}
void DxRowF32(const float* g, const void* dy, const void* x, float r, float m, void* dx, int64_t n) {
  DxRowT<DType::kFloat32>(g, dy, x, r, m, dx, n, false);  // fp32 rows: no bf16 stores
}

void ForwardRowsF32(const void* x, const float* g, void* y, float* rstd, float eps, int64_t rows, int64_t n) {
  ForwardRowsT<DType::kFloat32>(x, g, y, rstd, eps, rows, n);
}
void ForwardRowsBF16(const void* x, const float* g, void* y, float* rstd, float eps, int64_t rows, int64_t n) {
  ForwardRowsT<DType::kBFloat16>(x, g, y, rstd, eps, rows, n);
}
void ScaleRowsF32(const void* x, const float* g, void* y, const float* rstd, int64_t rows, int64_t n) {
  ScaleRowsT<DType::kFloat32>(x, g, y, rstd, rows, n);
}
void ScaleRowsBF16(const void* x, const float* g, void* y, const float* rstd, int64_t rows, int64_t n) {
  ScaleRowsT<DType::kBFloat16>(x, g, y, rstd, rows, n);
}
void BackwardRowsF32(const float* g, const void* dy, const void* x, const float* rstd, float* partial, void* dx,
                     int64_t rows, int64_t n) {
  BackwardRowsT<DType::kFloat32>(g, dy, x, rstd, partial, dx, rows, n);
}
void BackwardRowsBF16(const float* g, const void* dy, const void* x, const float* rstd, float* partial, void* dx,
                      int64_t rows, int64_t n) {
  BackwardRowsT<DType::kBFloat16>(g, dy, x, rstd, partial, dx, rows, n);
}

// out = x * r
void MulScalar(const float* x, float r, float* out, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vr = hn::Set(d, r);
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), vr), d, out + i);
  for (; i < n; ++i) out[i] = x[i] * r;
}

// out = g * t
void MulRow(const float* HWY_RESTRICT g, const float* t, float* out, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, g + i), hn::LoadU(d, t + i)), d, out + i);
  for (; i < n; ++i) out[i] = g[i] * t[i];
}

// dst += src
void AddRow(float* HWY_RESTRICT dst, const float* HWY_RESTRICT src, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Add(hn::LoadU(d, dst + i), hn::LoadU(d, src + i)), d, dst + i);
  for (; i < n; ++i) dst[i] += src[i];
}

}  // namespace leanstep::rmsnorm::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace leanstep::rmsnorm {
HWY_EXPORT(SumSquaresF32);
HWY_EXPORT(ScaleRowF32);
HWY_EXPORT(GdyXhatDotF32);
HWY_EXPORT(GdyXhatDotAccumulateF32);
HWY_EXPORT(DxRowF32);
HWY_EXPORT(ForwardRowsF32);
HWY_EXPORT(ForwardRowsBF16);
HWY_EXPORT(ScaleRowsF32);
HWY_EXPORT(ScaleRowsBF16);
HWY_EXPORT(BackwardRowsF32);
HWY_EXPORT(BackwardRowsBF16);
HWY_EXPORT(MulScalar);
HWY_EXPORT(MulRow);
HWY_EXPORT(AddRow);

namespace detail {

RowKernels row_kernels() {
  RowKernels k;
  k.sum_squares = HWY_DYNAMIC_DISPATCH(SumSquaresF32);
  k.scale_row = HWY_DYNAMIC_DISPATCH(ScaleRowF32);
  k.dot = HWY_DYNAMIC_DISPATCH(GdyXhatDotF32);
  k.dot_accumulate = HWY_DYNAMIC_DISPATCH(GdyXhatDotAccumulateF32);
  k.dx_row = HWY_DYNAMIC_DISPATCH(DxRowF32);
  return k;
}

ChunkKernels chunk_kernels(bool bf16) {
  ChunkKernels k;
  k.forward_rows = bf16 ? HWY_DYNAMIC_DISPATCH(ForwardRowsBF16) : HWY_DYNAMIC_DISPATCH(ForwardRowsF32);
  k.backward_rows = bf16 ? HWY_DYNAMIC_DISPATCH(BackwardRowsBF16) : HWY_DYNAMIC_DISPATCH(BackwardRowsF32);
  return k;
}

ScaleRowsKernel scale_rows_kernel(bool bf16) {
  return bf16 ? HWY_DYNAMIC_DISPATCH(ScaleRowsBF16) : HWY_DYNAMIC_DISPATCH(ScaleRowsF32);
}

void mul_scalar(const float* x, float r, float* out, int64_t n) { HWY_DYNAMIC_DISPATCH(MulScalar)(x, r, out, n); }
void mul_row(const float* g, const float* t, float* out, int64_t n) { HWY_DYNAMIC_DISPATCH(MulRow)(g, t, out, n); }
void add_row(float* dst, const float* src, int64_t n) { HWY_DYNAMIC_DISPATCH(AddRow)(dst, src, n); }

}  // namespace detail
}  // namespace leanstep::rmsnorm
#endif
