// The inner loop of the fused unpermute, in SIMD.
#pragma once

#include <cstddef>
#include <cstdint>

#include "leanstep/core.h"

namespace leanstep::moe::detail {

// acc[0..n) += float(src[0..n)) * prob for src of fp32, fp16 or bf16: the product
// rounded to fp32, then the sum rounded (no fused multiply-add), element by
// element exactly as the reference's scalar loop, only wider. `first`: acc is
// taken as +0 (not read), as a zeroed accumulator.
void accumulate_scaled(float* acc, const void* src, DType dtype, float prob, int64_t n, bool first);

// out[0..n) = cast(+0 + float(srcs[0][h]) * probs[0] + float(srcs[1][h]) * probs[1] + ...),
// added in slot order, each product rounded to fp32, then each sum (no fused
// multiply-add), then cast once: accumulate_scaled over the slots and one cast, the
// same bits, with the sums held in registers (no fp32 row stored and read back per
// slot). fp32 or bf16 rows; count 0: a row of +0.
void reduce_scaled(const void* const* srcs, const float* probs, int64_t count, DType dtype, void* out, int64_t n);

// The dot of unpermute's backward, sum of a[h] * b[h] in double for fp32 or bf16 rows,
// in one order on every machine: kDotPartials partial sums, partial[j] over h = j
// (mod kDotPartials) in increasing h, then a pairwise tree ((0+1)+(2+3))+... The SIMD
// kernel (scale_row_dot) keeps the partial sums in vectors; this is the same order in
// plain C++ (SVE, whose lanes are known only at run time, and the tests).
constexpr size_t kDotPartials = 16;
double dot_f64_reference(const void* a, const void* b, DType dtype, int64_t n);
// The end of that order: `partial` holds the sums over [0, h); adds the tail [h, n)
// and reduces the tree.
double dot_f64_finish(double* partial, const void* a, const void* b, DType dtype, int64_t h, int64_t n);
// The tree alone: ((p0 + p1) + (p2 + p3)) + ..., written out so that it inlines.
inline double dot_f64_tree(const double* p) {
  static_assert(kDotPartials == 16);
  const double q0 = (p[0] + p[1]) + (p[2] + p[3]), q1 = (p[4] + p[5]) + (p[6] + p[7]);
  const double q2 = (p[8] + p[9]) + (p[10] + p[11]), q3 = (p[12] + p[13]) + (p[14] + p[15]);
  return (q0 + q1) + (q2 + q3);
}

// One row of unpermute's backward for fp32 or bf16 rows, in one pass: out[h] =
// cast(dy[h] * prob) (the product rounded to fp32, then once to the dtype) and,
// with `dot`, the sum of dy[h] * x[h] in double, returned (0 without).
double scale_row_dot(const void* dy, const void* x, DType dtype, float prob, void* out, int64_t n, bool dot);

}  // namespace leanstep::moe::detail
