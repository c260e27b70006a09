// Row-major GEMM through OpenBLAS's cblas, overloaded for float and double so
// the model code is written once for both compute types.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <type_traits>

namespace leanstep::train::detail {

// C[m, n] = alpha * op(A) op(B) + beta * C, all row-major with leading dims.
// op(A) is [m, k] (A stored [k, m] when trans_a), op(B) is [k, n]. T is float
// (cblas_sgemm) or double (cblas_dgemm).
template <class T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "gemm: float or double");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C (BLAS would reject the leading dimensions)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const auto M = static_cast<blasint>(m), N = static_cast<blasint>(n), K = static_cast<blasint>(k);
  const auto LDA = static_cast<blasint>(lda), LDB = static_cast<blasint>(ldb), LDC = static_cast<blasint>(ldc);
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
  else
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
}

}  // namespace leanstep::train::detail
