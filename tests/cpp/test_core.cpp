#include <dlpack/dlpack.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/json_integer.h"
#include "core/parallel.h"
#include "leanstep/buffer.h"
#include "leanstep/core.h"
#include "bf16_rounding_util.h"
#include "test_util.h"

using namespace leanstep;
using leanstep::testing::test_seed;

namespace {

uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Oracle: round a double to the nearest representable value of a format with
// `mant` explicit mantissa bits and exponent range [emin, emax], ties to even.
double round_to_format(double x, int mant, int emin, int emax) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double ax = std::fabs(x);
  int e = std::ilogb(ax);
  if (e < emin) e = emin;  // subnormal spacing
  const double ulp = std::ldexp(1.0, e - mant);
  double q = ax / ulp;
  double r = std::nearbyint(q);  // ties-to-even under the default rounding mode
  double y = r * ulp;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mant), emax);
  const double overflow_threshold = max_finite + std::ldexp(1.0, emax - mant - 1);
  if (ax >= overflow_threshold) y = INFINITY;
  return std::copysign(y, x);
}

}  // namespace

TEST(Core, DtypeNamesAndSizes) {
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(dtype_from_name("bf16"), DType::kBFloat16);
  EXPECT_EQ(dtype_from_name("float32"), DType::kFloat32);
  EXPECT_LEANSTEP_ERROR(dtype_from_name("fp8"), "'name'");
}

TEST(Core, HalfRoundTripAllBitPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f)))) << h;
      continue;
    }
    EXPECT_EQ(float_to_half(f), h) << "half bits " << h;
  }
}

TEST(Core, BF16RoundTripAllBitPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(float_to_bf16(f), b);
  }
}

TEST(Core, ScalarConversionsMatchRoundingOracle) {
  std::mt19937_64 rng(test_seed());
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = bits_float(bits(rng));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(half_to_float(float_to_half(f)), static_cast<float>(round_to_format(f, 10, -14, 15))) << f;
    EXPECT_EQ(bf16_to_float(float_to_bf16(f)), static_cast<float>(round_to_format(f, 7, -126, 127))) << f;
  }
  EXPECT_TRUE(std::isinf(half_to_float(float_to_half(65520.0f))));
  EXPECT_EQ(half_to_float(float_to_half(65519.0f)), 65504.0f);
  // A NaN whose payload sits only in the low 16 bits must stay NaN in bf16.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));
}

TEST(Core, BulkConversionsMatchScalar) {
  std::mt19937_64 rng(test_seed());
  std::uniform_int_distribution<uint32_t> bits;
  for (int64_t n : {0, 1, 7, 16, 17, 1000, 4099}) {
    std::vector<float> src(static_cast<size_t>(n));
    for (auto& f : src) f = bits_float(bits(rng));
    for (DType dt : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      std::vector<uint8_t> packed(static_cast<size_t>(n) * dtype_size(dt) + 1);
      convert_from_f32(src.data(), packed.data(), dt, n);
      std::vector<float> back(static_cast<size_t>(n));
      convert_to_f32(packed.data(), dt, back.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float f = src[static_cast<size_t>(i)];
        float expect = f;
        if (dt == DType::kFloat16) expect = half_to_float(float_to_half(f));
        if (dt == DType::kBFloat16) expect = bf16_to_float(float_to_bf16(f));
        if (std::isnan(expect)) {
          EXPECT_TRUE(std::isnan(back[static_cast<size_t>(i)])) << dtype_name(dt) << " i=" << i;
        } else {
          EXPECT_EQ(float_bits(back[static_cast<size_t>(i)]), float_bits(expect))
              << dtype_name(dt) << " i=" << i << " value " << f;
        }
      }
    }
  }
}

TEST(Core, BulkBF16KeepsNaNWithLowPayload) {
  // NaNs whose payload sits only in the low 16 bits must not round to inf.
  std::vector<float> src(64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = bits_float((i % 2 ? 0xFF800000u : 0x7F800000u) | (1u + static_cast<uint32_t>(i)));
  std::vector<uint16_t> out(src.size());
  convert_from_f32(src.data(), out.data(), DType::kBFloat16, static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_TRUE(std::isnan(bf16_to_float(out[i]))) << i;
}

// fp32 values whose bf16 rounding is easy to get wrong: subnormals (the
// instruction reads them as zero), signed zeros, NaNs with payloads in either
// half, infinities, exact ties either way, the largest finite values (they
// round to inf), and random bits. `subnormal_every`: one subnormal in so many
// values (the rest of a vector pair then takes the fast path).
std::vector<float> bf16_rounding_cases(std::mt19937_64& rng, size_t n, size_t subnormal_every) {
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u,
                               0x7F800001u, 0x7FBF0000u, 0x3F808000u, 0x3F818000u, 0xBF808000u, 0x7F7FFFFFu,
                               0xFF7FFFFFu, 0x7F7F8000u, 0x00800000u, 0x80800000u, 0x3F7FFFFFu, 0x00008000u};
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t b = bits(rng);
    if (i % 7 == 3) b = specials[bits(rng) % std::size(specials)];
    if (subnormal_every && i % subnormal_every == subnormal_every / 2) b = (b & 0x807FFFFFu) | 1u;
    else if ((b & 0x7F800000u) == 0 && (b & 0x007FFFFFu) != 0) b |= 0x00800000u;  // no stray subnormal
    v[i] = bits_float(b);
  }
  return v;
}

TEST(Core, BF16HardwareRoundingGivesThePortableBits) {
  if (!detail::cpu_has_avx512_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ASSERT_TRUE(detail::g_bf16_hardware_rounding.load()) << "on by default where the CPU has it";
  std::mt19937_64 rng(test_seed());
  for (size_t subnormal_every : {size_t{0}, size_t{5}, size_t{97}}) {
    for (int64_t n : {0, 1, 31, 32, 33, 64, 1000, 4099}) {
      const std::vector<float> src = bf16_rounding_cases(rng, static_cast<size_t>(n), subnormal_every);
      std::vector<uint16_t> hardware(src.size()), portable(src.size());
      {
        leanstep::testing::HardwareBF16Rounding on(true);
        convert_from_f32(src.data(), hardware.data(), DType::kBFloat16, n);
      }
      {
        leanstep::testing::HardwareBF16Rounding off(false);
        convert_from_f32(src.data(), portable.data(), DType::kBFloat16, n);
      }
      for (size_t i = 0; i < src.size(); ++i) {
        ASSERT_EQ(hardware[i], portable[i]) << "n=" << n << " i=" << i << " bits 0x" << std::hex << float_bits(src[i]);
        ASSERT_EQ(hardware[i], float_to_bf16(src[i])) << "n=" << n << " i=" << i;
      }
    }
  }
}

TEST(Core, TensorViewBasics) {
  Buffer b(DType::kBFloat16, {3, 5});
  const Tensor& t = b.view();
  EXPECT_EQ(t.numel(), 15);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.byte_end() - t.byte_begin(), 30u);
  EXPECT_EQ(t.describe(), "bfloat16[3, 5] cpu");
  Tensor col = t;
  col.ndim = 1;
  col.shape[0] = 3;
  col.strides[0] = 5;
  EXPECT_FALSE(col.is_contiguous());
  EXPECT_EQ(col.byte_end() - col.byte_begin(), (2u * 5u + 1u) * 2u);
  Tensor bad(nullptr, DType::kFloat32, {4});
  EXPECT_LEANSTEP_ERROR(check_tensor(bad, "op", "x"), "argument 'x' has null data");
  Tensor empty(nullptr, DType::kFloat32, {0, 4});
  EXPECT_NO_THROW(check_tensor(empty, "op", "x"));
}

TEST(Core, FromDLPack) {
  float data[6] = {1, 2, 3, 4, 5, 6};
  int64_t shape[2] = {2, 3};
  int64_t strides[2] = {1, 2};  // column-major view
  DLTensor dl{};
  dl.data = data;
  dl.device = {kDLCPU, 0};
  dl.ndim = 2;
  dl.dtype = {kDLFloat, 32, 1};
  dl.shape = shape;
  dl.strides = strides;
  dl.byte_offset = 4;
  Tensor t = Tensor::from_dlpack(dl, "grads");
  EXPECT_EQ(t.data, static_cast<void*>(data + 1));
  EXPECT_EQ(t.strides[0], 1);
  EXPECT_FALSE(t.is_contiguous());
  dl.strides = nullptr;
  EXPECT_TRUE(Tensor::from_dlpack(dl).is_contiguous());
  dl.dtype = {kDLBfloat, 16, 1};
  EXPECT_EQ(Tensor::from_dlpack(dl).dtype, DType::kBFloat16);
  dl.dtype = {kDLComplex, 64, 1};
  EXPECT_LEANSTEP_ERROR(Tensor::from_dlpack(dl, "grads"), "argument 'grads' has unsupported DLPack dtype");
  dl.dtype = {kDLFloat, 32, 4};
  EXPECT_LEANSTEP_ERROR(Tensor::from_dlpack(dl, "grads"), "1 lane");
}

TEST(Core, ParallelChunksAreFixedAndCounted) {
  reset_counters();
  const int64_t n = 100003;
  std::vector<double> partial(static_cast<size_t>(detail::num_chunks(n, 4096)));
  for (int threads : {1, 2, 3, 4}) {
    set_num_threads(threads);
    detail::parallel_chunks(n, 4096, [&](int64_t c, int64_t b, int64_t e) {
      double s = 0;
      for (int64_t i = b; i < e; ++i) s += 1.0 / static_cast<double>(i + 1);
      partial[static_cast<size_t>(c)] = s;
    });
    std::vector<double> copy = partial;
    const double total = detail::tree_reduce(copy.data(), static_cast<int64_t>(copy.size()), 0.0,
                                             [](double a, double b) { return a + b; });
    static double first = total;
    EXPECT_EQ(std::memcmp(&first, &total, sizeof(double)), 0) << "threads=" << threads;
  }
  set_num_threads(2);
  EXPECT_EQ(counters().dispatches, 4u);
  EXPECT_EQ(counters().host_reads, 0u);
}

TEST(Core, ReadScalarCountsHostReads) {
  reset_counters();
  Buffer s(DType::kFloat32, {1});
  s.data_as<float>()[0] = 2.5f;
  EXPECT_EQ(read_scalar(s), 2.5);
  EXPECT_EQ(counters().host_reads, 1u);
  Buffer two(DType::kFloat32, {2});
  EXPECT_LEANSTEP_ERROR(read_scalar(two), "exactly 1 element");
}

namespace leanstep {
namespace {

TEST(Core, EmptyAndSizeOneViewsAreContiguousWhateverTheirStrides) {
  float storage[4] = {};
  Tensor empty(storage, DType::kInt64, {0});
  empty.strides[0] = 0;  // torch.as_tensor(np.array([], np.int64)) has stride (0,)
  EXPECT_TRUE(empty.is_contiguous());
  Tensor rows(storage, DType::kFloat32, {0, 4});
  rows.strides[0] = 7;
  rows.strides[1] = 3;
  EXPECT_TRUE(rows.is_contiguous());
  Tensor single(storage, DType::kFloat32, {1, 4});
  single.strides[0] = 99;
  EXPECT_TRUE(single.is_contiguous());
  single.strides[1] = 2;
  EXPECT_FALSE(single.is_contiguous());
}

// Brute force: two indices of the view reaching one element offset.
bool overlaps_by_enumeration(const Tensor& t) {
  std::vector<int64_t> offsets;
  std::array<int64_t, kMaxDims> index{};
  for (int64_t e = 0; e < t.numel(); ++e) {
    int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[d] * t.strides[d];
    offsets.push_back(offset);
    for (int d = t.ndim - 1; d >= 0 && ++index[d] == t.shape[d]; --d) index[d] = 0;
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

TEST(Core, SelfOverlapRuleNeverMissesAnOverlap) {
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_int_distribution<int> ndim(1, 3), size(0, 4), stride(-6, 6);
  int refused_without_overlap = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Tensor t(nullptr, DType::kFloat32, {1});
    t.ndim = ndim(rng);
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = size(rng);
      t.strides[d] = stride(rng);
    }
    const bool truth = overlaps_by_enumeration(t);
    if (truth) {
      EXPECT_TRUE(t.may_self_overlap()) << t.describe();  // never missed
    } else if (t.may_self_overlap()) {
      ++refused_without_overlap;  // conservative cases
    }
    if (t.is_contiguous()) {
      EXPECT_FALSE(t.may_self_overlap());
    }
  }
  // The proof only fails for interleaved layouts: a small minority.
  EXPECT_LT(refused_without_overlap, 300);
  Tensor expanded(nullptr, DType::kFloat32, {6});
  expanded.strides[0] = 0;
  EXPECT_LEANSTEP_ERROR(check_no_self_overlap(expanded, "op", "out"),
                        "op: argument 'out' must not overlap itself");
}

TEST(Core, ThreadCountIsBoundedWithANamedError) {
  const int before = num_threads();
  for (int n : {0, -3, kMaxThreads + 1, 100000})
    EXPECT_LEANSTEP_ERROR(set_num_threads(n), "set_num_threads: argument 'n' must be in [1, 1024]");
  EXPECT_EQ(num_threads(), before);
}

TEST(Core, AForkedChildRunsParallelLoopsOnItsOwnThread) {
  // GNU OpenMP's pool does not survive fork(): a parallel region in the child
  // of a process that used it waits forever. The child must run serially.
  std::atomic<int64_t> total{0};
  detail::parallel_chunks(1 << 20, 1 << 12, [&](int64_t, int64_t b, int64_t e) { total += e - b; });
  ASSERT_EQ(total.load(), 1 << 20);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(60);  // a hang fails the test instead of the whole run
    std::atomic<int64_t> child_total{0};
    detail::parallel_chunks(1 << 20, 1 << 12, [&](int64_t, int64_t b, int64_t e) { child_total += e - b; });
    _exit(child_total.load() == (1 << 20) && num_threads() == 1 ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace leanstep

// One rule for every JSON reader: a JSON integer that the type holds exactly, and
// nothing else (nlohmann keeps 4.0 and 1e300 as doubles, 2^63 as uint64, 2^64 as
// a double; get<int64_t>() would truncate, wrap or cast them out of range).
TEST(JsonInteger, HoldsExactlyTheIntegersTheTypeHolds) {
  using nlohmann::json;
  EXPECT_EQ(json_integer<int64_t>(json::parse("0")), int64_t{0});
  EXPECT_EQ(json_integer<int64_t>(json::parse("-7")), int64_t{-7});
  EXPECT_EQ(json_integer<int64_t>(json::parse("9223372036854775807")), INT64_MAX);
  EXPECT_EQ(json_integer<int64_t>(json::parse("-9223372036854775808")), INT64_MIN);
  for (const char* text : {"9223372036854775808", "18446744073709551615", "18446744073709551616", "4.0", "4.5",
                           "1e300", "-1e300", "\"4\"", "true", "null", "[1]", "{}"})
    EXPECT_FALSE(json_integer<int64_t>(json::parse(text)).has_value()) << text;
  // Unsigned types take the whole uint64 range and no negative value.
  EXPECT_EQ(json_integer<uint64_t>(json::parse("18446744073709551615")), UINT64_MAX);
  EXPECT_FALSE(json_integer<uint64_t>(json::parse("-1")).has_value());
  EXPECT_FALSE(json_integer<uint64_t>(json::parse("18446744073709551616")).has_value());
  // Narrower types: no silent narrowing.
  EXPECT_EQ(json_integer<int32_t>(json::parse("2147483647")), INT32_MAX);
  EXPECT_FALSE(json_integer<int32_t>(json::parse("2147483648")).has_value());
  EXPECT_FALSE(json_integer<int32_t>(json::parse("-2147483649")).has_value());
  EXPECT_EQ(json_integer<uint8_t>(json::parse("255")), uint8_t{255});
  EXPECT_FALSE(json_integer<uint8_t>(json::parse("256")).has_value());
}
