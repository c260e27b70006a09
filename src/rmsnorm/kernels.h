// The RMSNorm row kernels (Highway SIMD, src/rmsnorm/kernels_simd.cpp), as
// function pointers of the best target the running CPU supports; the fused
// path (fused.cpp) drives them. Rows are fp32, or bf16 for the bf16 variants
// (x, dy, y and dx in the row's dtype); gamma rows and partials are fp32.
#pragma once

#include <cstdint>

namespace leanstep::rmsnorm::detail {

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
  // The direct paths over `rows` consecutive rows of n (the row kernels' arithmetic, row by
  // row): y and rstd (rstd may be null); dx, with the chunk's dgamma partial when not null.
  void (*forward_rows)(const void* x, const float* g, void* y, float* rstd, float eps, int64_t rows, int64_t n);
  void (*backward_rows)(const float* g, const void* dy, const void* x, const float* rstd, float* partial,
                        void* dx, int64_t rows, int64_t n);
};

// Read at each call (tests switch the Highway target between calls).
RowKernels row_kernels(bool bf16);

// fp32 helpers of the scratch path: out = x * r; out = g * t; dst += src.
void mul_scalar(const float* x, float r, float* out, int64_t n);
void mul_row(const float* g, const float* t, float* out, int64_t n);
void add_row(float* dst, const float* src, int64_t n);

}  // namespace leanstep::rmsnorm::detail
