// The RMSNorm kernels (Highway SIMD, src/rmsnorm/kernels_simd.cpp), as
// function pointers of the best target the running CPU supports; the fused
// path (fused.cpp) drives them. Gamma rows and dgamma partials are fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace leanstep::rmsnorm::detail {

// Rows of a forward go in blocks that fit in L1 together (16 KiB, at most
// kMaxBlockRows rows, at least one): the statistics of the whole block first,
// then its scaling, from cache. One rule for every forward that blocks rows.
constexpr int64_t kMaxBlockRows = 16;
inline int64_t l1_block_rows(int64_t row_bytes) {
  constexpr int64_t kBlockBytes = int64_t{16} << 10;
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(row_bytes, 1), 1, kMaxBlockRows);
}

// The per-row scalars every path computes the same way (the direct and the
// scratch paths give the same bits): the mean of a row's sum, and 1 / rms.
inline float row_mean(float sum, int64_t n) { return sum / static_cast<float>(n); }
inline float inv_rms(float sum_squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(row_mean(sum_squares, n) + eps);
}

// One fp32 row at a time: the scratch path's kernels (fp16 and mixed-dtype
// calls widen their rows into fp32 scratch rows).
struct RowKernels {
  // sum of x^2 over n elements, in fp32
  float (*sum_squares)(const void* x, int64_t n);
  // y = cast((x * r) * g)
  void (*scale_row)(const void* x, float r, const float* g, void* y, int64_t n);
  // sum of (g*dy) * (x*r)
  float (*dot)(const float* g, const void* dy, const void* x, float r, int64_t n);
  // the same dot, and partial += dy * (x*r)
  float (*dot_accumulate)(const float* g, const void* dy, const void* x, float r, float* partial, int64_t n);
  // dx = r * (g*dy - (x*r) * m)
  void (*dx_row)(const float* g, const void* dy, const void* x, float r, float m, void* dx, int64_t n);
};

// The direct paths: `rows` consecutive rows of n, fp32 or bf16 (x, dy, y and dx in
// the rows' own dtype), each row with the arithmetic of the row kernels: y and rstd
// (rstd may be null); dx, with the chunk's dgamma partial when it is not null.
struct ChunkKernels {
  void (*forward_rows)(const void* x, const float* g, void* y, float* rstd, float eps, int64_t rows, int64_t n);
  void (*backward_rows)(const float* g, const void* dy, const void* x, const float* rstd, float* partial,
                        void* dx, int64_t rows, int64_t n);
};

// y = cast((x * rstd[row]) * g) for `rows` consecutive rows of n, fp32 or bf16 (x and y
// in the rows' own dtype): the second pass of forward_rows, given the rows' rstd.
using ScaleRowsKernel = void (*)(const void* x, const float* g, void* y, const float* rstd, int64_t rows,
                                 int64_t n);

// Read at each call (tests switch the Highway target between calls).
RowKernels row_kernels();
ScaleRowsKernel scale_rows_kernel(bool bf16);

// The sum of a row's squares in torch's CPU order (SumOrder::kTorchCpu,
// torch_order.cpp): fp32 or bf16 rows.
float sum_squares_torch_order(const void* x, DType dtype, int64_t n);
// rstd[i] = inv_rms of row i's sum in that order, for `rows` compact rows of `n`:
// the same bits, the short rows faster (the fused forward's; the reference sums
// with the function above).
void inv_rms_torch_order_rows(const void* x, DType dtype, int64_t rows, int64_t n, float eps,
                              float* rstd);
ChunkKernels chunk_kernels(bool bf16);

// fp32 helpers of the scratch path: out = x * r; out = g * t; dst += src.
void mul_scalar(const float* x, float r, float* out, int64_t n);
void mul_row(const float* g, const float* t, float* out, int64_t n);
void add_row(float* dst, const float* src, int64_t n);

}  // namespace leanstep::rmsnorm::detail
