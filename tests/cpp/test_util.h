// Shared test helpers: seeded random inputs (a fresh seed each run, printed so a
// failure can be replayed with LEANSTEP_TEST_SEED=<seed>), typed fills, and
// float64 oracles' comparison helpers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/core.h"

namespace leanstep::testing {

// Seed for this test: LEANSTEP_TEST_SEED if set, else fresh from the OS. Recorded
// as a test property (visible in the failure output and XML reports).
inline uint64_t test_seed() {
  uint64_t seed;
  if (const char* env = std::getenv("LEANSTEP_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  else seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::printf("[ seed     ] LEANSTEP_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// Fills a buffer of any floating dtype with N(mean, stddev) values, rounded to the dtype.
inline void fill_normal(const Tensor& t, std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0) {
  std::normal_distribution<double> dist(mean, stddev);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) store_from_double(t.data, t.dtype, i, dist(rng));
}

inline void fill_uniform(const Tensor& t, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) store_from_double(t.data, t.dtype, i, dist(rng));
}

inline std::vector<double> to_doubles(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = load_as_double(t.data, t.dtype, i);
  return v;
}

// Unit roundoff of a floating dtype (half the machine epsilon).
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return std::ldexp(1.0, -24);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat64: return std::ldexp(1.0, -53);
    default: return 0.0;
  }
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> k = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  return k;
}

// Bitwise equality of two views' memory (same dtype and numel, contiguous).
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.numel() == b.numel() &&
         (a.numel() == 0 || std::memcmp(a.data, b.data, a.nbytes()) == 0);
}

// EXPECT_THROW that also checks the message mentions `needle`.
#define EXPECT_LEANSTEP_ERROR(stmt, needle)                                                  \
  do {                                                                                       \
    try {                                                                                    \
      stmt;                                                                                  \
      ADD_FAILURE() << "expected leanstep::Error mentioning '" << (needle) << "'";           \
    } catch (const ::leanstep::Error& e) {                                                   \
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)                      \
          << "message: " << e.what() << "\nexpected to mention: " << (needle);               \
    }                                                                                        \
  } while (0)

}  // namespace leanstep::testing
