// Helpers of the gradient-engine tests: independent float64 oracles over
// arbitrary (strided) views, and grad buffers built from layouts.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/layout.h"
#include "test_util.h"

namespace leanstep::testing {

// Element offsets of a view in row-major order (written independently of the library's).
inline std::vector<int64_t> offsets_of(const Tensor& t) {
  std::vector<int64_t> out;
  const int64_t n = t.numel();
  out.reserve(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    int64_t rest = e, off = 0;
    for (int d = t.ndim - 1; d >= 0; --d) {
      off += (rest % t.shape[d]) * t.strides[d];
      rest /= t.shape[d];
    }
    out.push_back(off);
  }
  return out;
}

inline std::vector<double> values_of(const Tensor& t) {
  std::vector<double> v;
  for (int64_t off : offsets_of(t)) v.push_back(load_as_double(t.data, t.dtype, off));
  return v;
}

// The float64 oracle of the total norm of a list (each listed view counted once per listing).
inline double oracle_norm(const std::vector<Tensor>& views, double p) {
  if (std::isinf(p)) {
    double m = 0;
    for (const Tensor& t : views)
      for (double v : values_of(t)) {
        if (std::isnan(v)) return std::numeric_limits<double>::quiet_NaN();
        m = std::max(m, std::fabs(v));
      }
    return m;
  }
  // long double accumulation: the oracle is more precise than the engine.
  long double sum = 0;
  for (const Tensor& t : views)
    for (double v : values_of(t)) {
      const long double a = std::fabs(static_cast<long double>(v));
      sum += p == 2.0 ? a * a : p == 1.0 ? a : std::pow(a, static_cast<long double>(p));
    }
  return static_cast<double>(std::pow(sum, 1.0L / static_cast<long double>(p)));
}

inline bool oracle_nonfinite(const std::vector<Tensor>& views) {
  for (const Tensor& t : views)
    for (double v : values_of(t))
      if (!std::isfinite(v)) return true;
  return false;
}

// A 1-element backend scalar.
struct Scalar {
  Buffer buffer;
  explicit Scalar(DType dtype = DType::kFloat32, double value = 0.0) : buffer(dtype, {1}) { set(value); }
  void set(double value) { store_from_double(buffer.data(), buffer.view().dtype, 0, value); }
  double get() const { return load_as_double(buffer.data(), buffer.view().dtype, 0); }
  const Tensor& t() const { return buffer.view(); }
  const Tensor* p() const { return &buffer.view(); }
};

// A strided view: every `step`-th element of `rows` x `cols` inside base.
inline Tensor strided_view(void* base, DType dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  Tensor t;
  t.data = base;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = row_stride;
  t.strides[1] = col_stride;
  return t;
}

inline Tensor sub_view(const Tensor& buffer, int64_t offset, std::initializer_list<int64_t> shape) {
  char* p = static_cast<char*>(buffer.data) + offset * static_cast<int64_t>(buffer.element_size());
  return Tensor(p, buffer.dtype, shape);
}

// Copies of buffers' bytes, to run the fused and the reference path on the same input.
inline std::vector<char> snapshot(const Tensor& t) {
  std::vector<char> bytes(t.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), t.data, bytes.size());
  return bytes;
}
inline void restore(const Tensor& t, const std::vector<char>& bytes) {
  if (!bytes.empty()) std::memcpy(t.data, bytes.data(), bytes.size());
}

}  // namespace leanstep::testing
