// Straightforward kernels for the training model's tests: the float64 oracle
// of the gradient checks, and the semantics the library's kernels (the fp32
// trainer's: the dispatch layer's ops and moe::route) must match.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "leanstep/core.h"
#include "train/model.h"

namespace leanstep::train::detail {

template <class T>
Kernels<T> reference_kernels() {
  Kernels<T> k;
  k.route = [](const T* logits, int64_t n, int64_t e, int64_t topk, bool normalize, uint8_t* map, T* probs) {
    std::vector<int64_t> order(static_cast<size_t>(e));
    std::vector<T> pf(static_cast<size_t>(e));
    for (int64_t t = 0; t < n; ++t) {
      const T* lg = logits + t * e;
      const T mx = *std::max_element(lg, lg + e);
      T sum = 0;
      for (int64_t j = 0; j < e; ++j) sum += (pf[static_cast<size_t>(j)] = std::exp(lg[j] - mx));
      for (int64_t j = 0; j < e; ++j) pf[static_cast<size_t>(j)] /= sum;
      std::iota(order.begin(), order.end(), int64_t{0});
      std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                        [&](int64_t a, int64_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
      T chosen = 0;
      for (int64_t j = 0; j < topk; ++j) chosen += pf[static_cast<size_t>(order[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t ex = order[static_cast<size_t>(j)];
        map[t * e + ex] = 1;
        probs[t * e + ex] = normalize ? pf[static_cast<size_t>(ex)] / chosen : pf[static_cast<size_t>(ex)];
      }
    }
  };
  k.rmsnorm_forward = [](const T* x, const T* g, int64_t rows, int64_t h, double eps, T* y, T* rstd) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * h;
      T ss = 0;
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const T rs = T(1) / std::sqrt(ss / static_cast<T>(h) + static_cast<T>(eps));
      rstd[r] = rs;
      for (int64_t i = 0; i < h; ++i) y[r * h + i] = xr[i] * rs * g[i];
    }
  };
  k.rmsnorm_backward = [](const T* dy, const T* x, const T* rstd, const T* g, int64_t rows, int64_t h, T* dx) {
    for (int64_t r = 0; r < rows; ++r) {
      const T rs = rstd[r];
      T dot = 0;
      for (int64_t i = 0; i < h; ++i) dot += g[i] * dy[r * h + i] * x[r * h + i] * rs;
      const T mean = dot / static_cast<T>(h);
      for (int64_t i = 0; i < h; ++i)
        dx[r * h + i] = rs * (g[i] * dy[r * h + i] - x[r * h + i] * rs * mean);
    }
  };
  k.permute = [](const T* tokens, int64_t ntok, int64_t h, const uint8_t* map, const T* probs, int64_t e,
                 int64_t nout, T* out, T* out_probs, int64_t* sorted) {
    int64_t i = 0;
    for (int64_t ex = 0; ex < e; ++ex)
      for (int64_t t = 0; t < ntok; ++t) {
        if (!map[t * e + ex]) continue;
        if (i >= nout) throw Error("train: permute: more routed pairs than num_out_tokens");
        std::memcpy(out + i * h, tokens + t * h, sizeof(T) * static_cast<size_t>(h));
        if (out_probs) out_probs[i] = probs[t * e + ex];
        sorted[i++] = t;
      }
  };
  k.unpermute = [](const T* permuted, const int64_t* sorted, const T* probs, int64_t nout, int64_t h,
                   int64_t ntok, T* out) {
    std::fill(out, out + ntok * h, T(0));
    for (int64_t i = 0; i < nout; ++i) {
      const T w = probs ? probs[i] : T(1);
      T* o = out + sorted[i] * h;
      for (int64_t j = 0; j < h; ++j) o[j] += permuted[i * h + j] * w;
    }
  };
  k.permute_backward = [](const T* dpermuted, const int64_t* sorted, int64_t nout, int64_t h, int64_t ntok,
                          T* dtokens) {
    std::fill(dtokens, dtokens + ntok * h, T(0));
    for (int64_t i = 0; i < nout; ++i)
      for (int64_t j = 0; j < h; ++j) dtokens[sorted[i] * h + j] += dpermuted[i * h + j];
  };
  k.unpermute_backward = [](const T* dout, const T* permuted, const int64_t* sorted, const T* probs,
                            int64_t nout, int64_t h, int64_t /*ntok*/, T* dpermuted, T* dprobs) {
    for (int64_t i = 0; i < nout; ++i) {
      const T* d = dout + sorted[i] * h;
      T dot = 0;
      for (int64_t j = 0; j < h; ++j) {
        dpermuted[i * h + j] = d[j] * probs[i];
        dot += d[j] * permuted[i * h + j];
      }
      dprobs[i] = dot;
    }
  };
  return k;
}

}  // namespace leanstep::train::detail
