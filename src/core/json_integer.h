// A JSON value read as an integer, one rule for every JSON reader (configs,
// crossover plans, LoRA layouts, step logs, safetensors headers). nlohmann keeps
// a float (4.0, 1e300) as a double, a literal above 2^63 - 1 as uint64 and one
// beyond 2^64 as a double: get<int64_t>() would truncate the first, wrap the
// second and cast the third out of range (undefined behaviour). Each caller
// checks its own limits and words its own error.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

namespace leanstep {

// The value of v if it is a JSON integer that Int holds exactly; nullopt for
// anything else (a float, an integer out of Int's range, a string, ...).
template <class Int>
std::optional<Int> json_integer(const nlohmann::json& v) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>);
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (!std::in_range<Int>(u)) return std::nullopt;
    return static_cast<Int>(u);
  }
  const int64_t s = v.get<int64_t>();
  if (!std::in_range<Int>(s)) return std::nullopt;
  return static_cast<Int>(s);
}

}  // namespace leanstep
