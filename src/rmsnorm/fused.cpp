// The fused RMSNorm kernels: Highway SIMD row kernels (dynamic dispatch to the
// best target of the running CPU) driven by fixed row chunks in parallel.
//
// Each row is read from memory once: fp16/bf16 rows are widened into an fp32
// scratch row (L1/L2 resident) and the second pass of a row runs from cache.
// Statistics are accumulated in fp32 in 4 independent vector accumulators.
// Row tails are run through the same vector code on a zero-padded copy, so every
// element of a row sees exactly the same arithmetic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/parallel.h"
#include "leanstep/rmsnorm.h"
#include "rmsnorm/common.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/rmsnorm/fused.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace leanstep::rmsnorm::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kPad = HWY_MAX_BYTES / sizeof(float);  // room for one vector of any target

// sum of x[i]^2
float SumSquares(const float* HWY_RESTRICT x, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    const auto v0 = hn::LoadU(d, x + i), v1 = hn::LoadU(d, x + i + N);
    const auto v2 = hn::LoadU(d, x + i + 2 * N), v3 = hn::LoadU(d, x + i + 3 * N);
    a0 = hn::MulAdd(v0, v0, a0);
    a1 = hn::MulAdd(v1, v1, a1);
    a2 = hn::MulAdd(v2, v2, a2);
    a3 = hn::MulAdd(v3, v3, a3);
  }
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(d, x + i);
    a0 = hn::MulAdd(v, v, a0);
  }
  if (i < n) {
    HWY_ALIGN float tail[kPad] = {};
    std::memcpy(tail, x + i, static_cast<size_t>(n - i) * sizeof(float));
    const auto v = hn::Load(d, tail);
    a1 = hn::MulAdd(v, v, a1);
  }
  const auto total = hn::Add(hn::Add(a0, a1), hn::Add(a2, a3));
  return hn::GetLane(hn::SumOfLanes(d, total));
}

// out = (x * r) * g   (scale then cast: the caller casts out once)
void ScaleRow(const float* x, float r, const float* HWY_RESTRICT g, float* out, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vr = hn::Set(d, r);
  int64_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, x + i), vr), hn::LoadU(d, g + i)), d, out + i);
  for (; i < n; ++i) out[i] = x[i] * r * g[i];  // same two fp32 roundings as the vector lanes
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

// sum of (g*dy) * (x*r)
float GdyXhatDot(const float* HWY_RESTRICT g, const float* HWY_RESTRICT dy, const float* HWY_RESTRICT x,
                 float r, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vr = hn::Set(d, r);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  auto term = [&](const float* gp, const float* dyp, const float* xp) {
    return hn::Mul(hn::Mul(hn::LoadU(d, gp), hn::LoadU(d, dyp)), hn::Mul(hn::LoadU(d, xp), vr));
  };
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, term(g + i, dy + i, x + i));
    a1 = hn::Add(a1, term(g + i + N, dy + i + N, x + i + N));
    a2 = hn::Add(a2, term(g + i + 2 * N, dy + i + 2 * N, x + i + 2 * N));
    a3 = hn::Add(a3, term(g + i + 3 * N, dy + i + 3 * N, x + i + 3 * N));
  }
  for (; i + N <= n; i += N) a0 = hn::Add(a0, term(g + i, dy + i, x + i));
  if (i < n) {
    HWY_ALIGN float tg[kPad] = {}, tdy[kPad] = {}, tx[kPad] = {};
    const size_t bytes = static_cast<size_t>(n - i) * sizeof(float);
    std::memcpy(tg, g + i, bytes);
    std::memcpy(tdy, dy + i, bytes);
    std::memcpy(tx, x + i, bytes);
    a1 = hn::Add(a1, term(tg, tdy, tx));
  }
  const auto total = hn::Add(hn::Add(a0, a1), hn::Add(a2, a3));
  return hn::GetLane(hn::SumOfLanes(d, total));
}

// dx = r * (g*dy - xhat*m), xhat = x*r; with kAccumulate also partial += dy*xhat.
// The frozen and trainable variants share this code, so their dx is bitwise equal.
template <bool kAccumulate>
HWY_INLINE void DxRowImpl(const float* HWY_RESTRICT g, const float* dy, const float* x, float r, float m,
                          float* dx, float* HWY_RESTRICT partial, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vr = hn::Set(d, r);
  const auto vm = hn::Set(d, m);
  auto step = [&](const float* gp, const float* dyp, const float* xp, float* dxp, float* pp) {
    const auto vdy = hn::LoadU(d, dyp);
    const auto xhat = hn::Mul(hn::LoadU(d, xp), vr);
    const auto g_dy = hn::Mul(hn::LoadU(d, gp), vdy);
    hn::StoreU(hn::Mul(vr, hn::NegMulAdd(xhat, vm, g_dy)), d, dxp);
    if constexpr (kAccumulate) hn::StoreU(hn::MulAdd(vdy, xhat, hn::LoadU(d, pp)), d, pp);
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) step(g + i, dy + i, x + i, dx + i, partial + i);
  if (i < n) {
    HWY_ALIGN float tg[kPad] = {}, tdy[kPad] = {}, tx[kPad] = {}, tdx[kPad] = {}, tp[kPad] = {};
    const size_t bytes = static_cast<size_t>(n - i) * sizeof(float);
    std::memcpy(tg, g + i, bytes);
    std::memcpy(tdy, dy + i, bytes);
    std::memcpy(tx, x + i, bytes);
    if constexpr (kAccumulate) std::memcpy(tp, partial + i, bytes);
    step(tg, tdy, tx, tdx, tp);
    std::memcpy(dx + i, tdx, bytes);
    if constexpr (kAccumulate) std::memcpy(partial + i, tp, bytes);
  }
}

void DxRow(const float* g, const float* dy, const float* x, float r, float m, float* dx, float* partial,
           int64_t n) {
  DxRowImpl<false>(g, dy, x, r, m, dx, partial, n);
}
void DxRowAccumulate(const float* g, const float* dy, const float* x, float r, float m, float* dx,
                     float* partial, int64_t n) {
  DxRowImpl<true>(g, dy, x, r, m, dx, partial, n);
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
HWY_EXPORT(SumSquares);
HWY_EXPORT(ScaleRow);
HWY_EXPORT(MulScalar);
HWY_EXPORT(MulRow);
HWY_EXPORT(GdyXhatDot);
HWY_EXPORT(DxRow);
HWY_EXPORT(DxRowAccumulate);
HWY_EXPORT(AddRow);

namespace {

// A row of a contiguous [rows, H] view as fp32: the memory itself for fp32,
// else widened into `scratch`.
const float* row_as_f32(const Tensor& t, int64_t row, int64_t h, float* scratch) {
  const char* p = static_cast<const char*>(t.data) + static_cast<size_t>(row * h) * t.element_size();
  if (t.dtype == DType::kFloat32) return reinterpret_cast<const float*>(p);
  convert_to_f32(p, t.dtype, scratch, h);
  return scratch;
}

void* row_ptr(const Tensor& t, int64_t row, int64_t h) {
  return static_cast<char*>(t.data) + static_cast<size_t>(row * h) * t.element_size();
}

// Per-chunk scratch rows; allocated once per chunk, outside the row loop.
struct Scratch {
  explicit Scratch(int64_t h, int rows) : data(static_cast<size_t>(h) * static_cast<size_t>(rows)), h(h) {}
  float* row(int i) { return data.data() + static_cast<size_t>(i) * static_cast<size_t>(h); }
  std::vector<float> data;
  int64_t h;
};

}  // namespace

void forward_fused(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                   const Options& options) {
  const auto s = detail::check_forward("rmsnorm::forward_fused", x, gamma, y, rstd, options);
  const int64_t h = s.hidden;
  const std::vector<float> g = detail::effective_gamma(gamma, options.zero_centered_gamma);
  const float eps = static_cast<float>(options.eps);
  const bool cast_then_scale = options.rounding == RoundingOrder::kCastThenScale;
  float* rstd_out = static_cast<float*>(rstd.data);

  leanstep::detail::parallel_chunks(s.rows, detail::rows_per_chunk(h), [&](int64_t, int64_t begin, int64_t end) {
    Scratch scratch(h, 3);  // widened x, fp32 output, x-dtype rounding buffer
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = row_as_f32(x, row, h, scratch.row(0));
      const float sum_squares = HWY_DYNAMIC_DISPATCH(SumSquares)(xr, h);
      const float r = 1.0f / std::sqrt(sum_squares / static_cast<float>(h) + eps);
      rstd_out[row] = r;
      float* out = y.dtype == DType::kFloat32 ? static_cast<float*>(row_ptr(y, row, h)) : scratch.row(1);
      if (!cast_then_scale) {
        HWY_DYNAMIC_DISPATCH(ScaleRow)(xr, r, g.data(), out, h);
      } else {
        HWY_DYNAMIC_DISPATCH(MulScalar)(xr, r, out, h);
        if (x.dtype != DType::kFloat32) {  // round x*r to x's dtype, then multiply by g in fp32
          convert_from_f32(out, scratch.row(2), x.dtype, h);
          convert_to_f32(scratch.row(2), x.dtype, out, h);
        }
        HWY_DYNAMIC_DISPATCH(MulRow)(g.data(), out, out, h);
      }
      if (y.dtype != DType::kFloat32) convert_from_f32(out, row_ptr(y, row, h), y.dtype, h);
    }
  });
}

void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                    const Tensor& dx, const Tensor* dgamma, const Options& options) {
  const auto s = detail::check_backward("rmsnorm::backward_fused", dy, x, rstd, gamma, dx, dgamma, options);
  const int64_t h = s.hidden;
  const std::vector<float> g = detail::effective_gamma(gamma, options.zero_centered_gamma);
  const float* rstd_in = static_cast<const float*>(rstd.data);
  const int64_t chunk_rows = detail::rows_per_chunk(h);
  const int64_t chunks = leanstep::detail::num_chunks(s.rows, chunk_rows);
  const bool trainable = dgamma != nullptr;

  // Trainable only: one fp32 partial dgamma row per fixed chunk of rows.
  std::vector<float> partials(trainable ? static_cast<size_t>(std::max<int64_t>(chunks, 1) * h) : 0, 0.0f);

  leanstep::detail::parallel_chunks(s.rows, chunk_rows, [&](int64_t c, int64_t begin, int64_t end) {
    Scratch scratch(h, 3);  // widened dy, widened x, fp32 dx
    float* partial = trainable ? partials.data() + static_cast<size_t>(c * h) : nullptr;
    for (int64_t row = begin; row < end; ++row) {
      const float* dyr = row_as_f32(dy, row, h, scratch.row(0));
      const float* xr = row_as_f32(x, row, h, scratch.row(1));
      const float r = rstd_in[row];
      const float dot = HWY_DYNAMIC_DISPATCH(GdyXhatDot)(g.data(), dyr, xr, r, h);
      const float mean_dot = dot / static_cast<float>(h);
      float* out = dx.dtype == DType::kFloat32 ? static_cast<float*>(row_ptr(dx, row, h)) : scratch.row(2);
      if (trainable) HWY_DYNAMIC_DISPATCH(DxRowAccumulate)(g.data(), dyr, xr, r, mean_dot, out, partial, h);
      else HWY_DYNAMIC_DISPATCH(DxRow)(g.data(), dyr, xr, r, mean_dot, out, nullptr, h);
      if (dx.dtype != DType::kFloat32) convert_from_f32(out, row_ptr(dx, row, h), dx.dtype, h);
    }
  });
  if (!trainable) return;

  // Fixed pairwise tree over the chunk partials (depends on the shape only),
  // parallel over column blocks: every column sees the same additions in the
  // same order whatever the thread count or column blocking.
  float* p = partials.data();
  leanstep::detail::parallel_chunks(h, 4096, [&](int64_t, int64_t col_begin, int64_t col_end) {
    for (int64_t width = 1; width < chunks; width *= 2)
      for (int64_t i = 0; i + width < chunks; i += 2 * width)
        HWY_DYNAMIC_DISPATCH(AddRow)(p + i * h + col_begin, p + (i + width) * h + col_begin, col_end - col_begin);
  });
  convert_from_f32(p, dgamma->data, dgamma->dtype, h);  // rows == 0 leaves zeros: an empty sum
}

}  // namespace leanstep::rmsnorm
#endif
