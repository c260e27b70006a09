// Row-major GEMM through OpenBLAS's cblas, overloaded for float and double so
// the model code is written once for both compute types.
#pragma once

#include <cblas.h>

#include <cstdint>

namespace leanstep::train::detail {

// C[m, n] = alpha * op(A) op(B) + beta * C, all row-major with leading dims.
// op(A) is [m, k] (A stored [k, m] when trans_a), op(B) is [k, n].
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C (BLAS would reject the leading dimensions)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                 const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C (BLAS would reject the leading dimensions)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

}  // namespace leanstep::train::detail
