// The fused RMSNorm: the SIMD row kernels (src/rmsnorm/kernels.h) driven by
// fixed row chunks in parallel.
//
// Each row is read from memory once and its second pass runs from cache. fp32
// and bf16 rows are read and written in their own dtype by the kernels; fp16
// and mixed-dtype calls widen rows into fp32 scratch rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/parallel.h"
#include "leanstep/rmsnorm.h"
#include "rmsnorm/checks.h"
#include "rmsnorm/kernels.h"

namespace leanstep::rmsnorm {

namespace {

// fp32 and bf16 rows are read and written in place by the typed kernels; other
// dtypes (fp16, or mixed dtypes) go through fp32 scratch rows.
bool direct_dtype(DType t) { return t == DType::kFloat32 || t == DType::kBFloat16; }

const void* row_ptr(const Tensor& t, int64_t row, int64_t h) {
  return static_cast<const char*>(t.data) + static_cast<size_t>(row * h) * t.element_size();
}
void* row_ptr_mut(const Tensor& t, int64_t row, int64_t h) {
  return static_cast<char*>(t.data) + static_cast<size_t>(row * h) * t.element_size();
}

// A row as fp32: the memory itself for fp32, else widened into `scratch`.
const float* row_as_f32(const Tensor& t, int64_t row, int64_t h, float* scratch) {
  if (t.dtype == DType::kFloat32) return static_cast<const float*>(row_ptr(t, row, h));
  convert_to_f32(row_ptr(t, row, h), t.dtype, scratch, h);
  return scratch;
}

// Per-chunk scratch rows (only the scratch path uses them).
struct Scratch {
  Scratch(int64_t h, int rows) : data(static_cast<size_t>(h) * static_cast<size_t>(rows)), h(h) {}
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
  const bool direct = x.dtype == y.dtype && direct_dtype(x.dtype) && !cast_then_scale;
  float* rstd_out = static_cast<float*>(rstd.data);
  const bool torch_order = options.sum_order == SumOrder::kTorchCpu;
  if (direct && torch_order) {  // the rstd of a block of rows, then its scaling from cache
    const auto scale_rows = detail::scale_rows_kernel(x.dtype == DType::kBFloat16);
    const int64_t block = detail::l1_block_rows(h * static_cast<int64_t>(x.element_size()));
    leanstep::detail::parallel_chunks(s.rows, detail::rows_per_chunk(h), [&](int64_t, int64_t begin, int64_t end) {
      for (int64_t first = begin; first < end; first += block) {
        const int64_t count = std::min(block, end - first);
        detail::inv_rms_torch_order_rows(row_ptr(x, first, h), x.dtype, count, h, eps, rstd_out + first);
        scale_rows(row_ptr(x, first, h), g.data(), row_ptr_mut(y, first, h), rstd_out + first, count, h);
      }
    });
    return;
  }
  if (direct) {  // two passes over each row in its own dtype; the second from cache
    const auto forward_rows = detail::chunk_kernels(x.dtype == DType::kBFloat16).forward_rows;
    leanstep::detail::parallel_chunks(s.rows, detail::rows_per_chunk(h), [&](int64_t, int64_t begin, int64_t end) {
      forward_rows(row_ptr(x, begin, h), g.data(), row_ptr_mut(y, begin, h), rstd_out + begin, eps, end - begin, h);
    });
    return;
  }
  const detail::RowKernels kernels = detail::row_kernels();
  leanstep::detail::parallel_chunks(s.rows, detail::rows_per_chunk(h), [&](int64_t, int64_t begin, int64_t end) {
    Scratch scratch(h, 3);  // widened x, fp32 output, x-dtype rounding buffer
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = row_as_f32(x, row, h, scratch.row(0));
      const float sum_squares = torch_order ? detail::sum_squares_torch_order(xr, DType::kFloat32, h)
                                            : kernels.sum_squares(xr, h);
      const float r = detail::inv_rms(sum_squares, h, eps);
      rstd_out[row] = r;
      float* out = y.dtype == DType::kFloat32 ? static_cast<float*>(row_ptr_mut(y, row, h)) : scratch.row(1);
      if (!cast_then_scale) {
        kernels.scale_row(xr, r, g.data(), out, h);
      } else {
        detail::mul_scalar(xr, r, out, h);
        if (x.dtype != DType::kFloat32) {  // round x*r to x's dtype, then multiply by g in fp32
          convert_from_f32(out, scratch.row(2), x.dtype, h);
          convert_to_f32(scratch.row(2), x.dtype, out, h);
        }
        detail::mul_row(g.data(), out, out, h);
      }
      if (y.dtype != DType::kFloat32) convert_from_f32(out, row_ptr_mut(y, row, h), y.dtype, h);
    }
  });
}

size_t backward_fused_workspace_bytes(const Tensor& x, bool trainable) {
  if (!trainable || x.ndim < 1 || x.shape[x.ndim - 1] < 1) return 0;
  const int64_t h = x.shape[x.ndim - 1];
  const int64_t rows = x.numel() / h;
  const int64_t chunks = leanstep::detail::num_chunks(rows, detail::rows_per_chunk(h));
  return static_cast<size_t>(std::max<int64_t>(chunks, 1) * h) * sizeof(float);
}

void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                    const Tensor& dx, const Tensor* dgamma, const Options& options) {
  backward_fused(dy, x, rstd, gamma, dx, dgamma, options, nullptr, 0);
}

void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                    const Tensor& dx, const Tensor* dgamma, const Options& options, void* workspace,
                    size_t workspace_bytes) {
  const auto s = detail::check_backward("rmsnorm::backward_fused", dy, x, rstd, gamma, dx, dgamma, options);
  const int64_t h = s.hidden;
  const std::vector<float> g = detail::effective_gamma(gamma, options.zero_centered_gamma);
  const float* rstd_in = static_cast<const float*>(rstd.data);
  const int64_t chunk_rows = detail::rows_per_chunk(h);
  const int64_t chunks = leanstep::detail::num_chunks(s.rows, chunk_rows);
  const bool trainable = dgamma != nullptr;
  const bool direct = dy.dtype == x.dtype && dx.dtype == x.dtype && direct_dtype(x.dtype);
  // Pass 1: the mean of g*dy*xhat (trainable: the dgamma partial too, in the
  // pass that streams dy and x); pass 2: dx, the frozen kernel, from cache.
  const auto backward_rows = detail::chunk_kernels(x.dtype == DType::kBFloat16).backward_rows;  // direct
  const detail::RowKernels kernels = detail::row_kernels();                                     // scratch
  auto mean_dot = [&](const void* dyr, const void* xr, float r, float* partial) {
    const float dot = partial ? kernels.dot_accumulate(g.data(), dyr, xr, r, partial, h)
                              : kernels.dot(g.data(), dyr, xr, r, h);
    return detail::row_mean(dot, h);
  };

  // Trainable only: one fp32 partial dgamma row per fixed chunk of rows, in the
  // caller's workspace when it is large enough.
  const size_t partial_floats = trainable ? static_cast<size_t>(std::max<int64_t>(chunks, 1) * h) : 0;
  std::vector<float> own;
  float* partials_data = nullptr;
  if (trainable) {
    if (workspace && workspace_bytes >= partial_floats * sizeof(float)) {
      partials_data = static_cast<float*>(workspace);
      std::memset(partials_data, 0, partial_floats * sizeof(float));
    } else {
      own.assign(partial_floats, 0.0f);
      partials_data = own.data();
    }
  }

  leanstep::detail::parallel_chunks(s.rows, chunk_rows, [&](int64_t c, int64_t begin, int64_t end) {
    float* partial = trainable ? partials_data + static_cast<size_t>(c * h) : nullptr;
    if (direct) {  // two passes over each row in its own dtype; the second from cache
      backward_rows(g.data(), row_ptr(dy, begin, h), row_ptr(x, begin, h), rstd_in + begin, partial,
                    row_ptr_mut(dx, begin, h), end - begin, h);
      return;
    }
    Scratch scratch(h, 3);  // widened dy, widened x, fp32 dx
    for (int64_t row = begin; row < end; ++row) {
      const float* dyr = row_as_f32(dy, row, h, scratch.row(0));
      const float* xr = row_as_f32(x, row, h, scratch.row(1));
      const float r = rstd_in[row];
      float* out = dx.dtype == DType::kFloat32 ? static_cast<float*>(row_ptr_mut(dx, row, h)) : scratch.row(2);
      kernels.dx_row(g.data(), dyr, xr, r, mean_dot(dyr, xr, r, partial), out, h);
      if (dx.dtype != DType::kFloat32) convert_from_f32(out, row_ptr_mut(dx, row, h), dx.dtype, h);
    }
  });
  if (!trainable) return;

  // Fixed pairwise tree over the chunk partials (depends on the shape only),
  // parallel over column blocks: every column sees the same additions in the
  // same order whatever the thread count or column blocking.
  float* p = partials_data;
  leanstep::detail::parallel_chunks(h, 4096, [&](int64_t, int64_t col_begin, int64_t col_end) {
    for (int64_t width = 1; width < chunks; width *= 2)
      for (int64_t i = 0; i + width < chunks; i += 2 * width)
        detail::add_row(p + i * h + col_begin, p + (i + width) * h + col_begin, col_end - col_begin);
  });
  convert_from_f32(p, dgamma->data, dgamma->dtype, h);  // rows == 0 leaves zeros: an empty sum
}

}  // namespace leanstep::rmsnorm
