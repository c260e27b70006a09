// The inner loop of the fused unpermute, in SIMD.
#pragma once

#include <cstdint>

#include "leanstep/core.h"

namespace leanstep::moe::detail {

// acc[0..n) += float(src[0..n)) * prob for src of fp32, fp16 or bf16: the product
// rounded to fp32, then the sum rounded (no fused multiply-add), element by
// element exactly as the reference's scalar loop, only wider.
void accumulate_scaled(float* acc, const void* src, DType dtype, float prob, int64_t n);

}  // namespace leanstep::moe::detail
