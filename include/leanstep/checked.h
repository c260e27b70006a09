// Checked 64-bit integer arithmetic for size computations: a product or sum
// that does not fit in int64 throws Error naming what was being computed,
// instead of wrapping around (signed overflow is undefined behaviour).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "leanstep/core.h"

namespace leanstep {

// a * b; throws Error("<where>: <what> overflows int64 (<a> x <b>)").
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view where, std::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    throw Error(std::string(where) + ": " + std::string(what) + " overflows int64 (" + std::to_string(a) + " x " +
                std::to_string(b) + ")");
  return out;
}

// a + b; throws Error("<where>: <what> overflows int64 (<a> + <b>)").
inline int64_t checked_add(int64_t a, int64_t b, std::string_view where, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out))
    throw Error(std::string(where) + ": " + std::string(what) + " overflows int64 (" + std::to_string(a) + " + " +
                std::to_string(b) + ")");
  return out;
}

// Product of all factors, checked.
inline int64_t checked_product(std::initializer_list<int64_t> factors, std::string_view where, std::string_view what) {
  int64_t out = 1;
  for (int64_t f : factors) out = checked_mul(out, f, where, what);
  return out;
}

}  // namespace leanstep
