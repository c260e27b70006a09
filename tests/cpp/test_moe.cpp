// MoE permutation: permute / unpermute / backward against oracles written from
// the semantics, sort == fused bitwise, num_out_tokens enforcement, padding
// paths, empty and degenerate inputs, 64-bit indexing and bad input.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <random>

#include "hwy/targets.h"
#include "leanstep/buffer.h"
#include "leanstep/moe.h"
#include "moe_util.h"
#include "test_util.h"

namespace leanstep::testing {
namespace {

using moe::Method;

struct PermuteOut {
  Buffer permuted, permuted_probs, indices;
};

PermuteOut run_permute(const Tensor& tokens, const Tensor& map, const Tensor* probs, std::optional<int64_t> num_out,
                       bool drop_and_pad, Method method, DType index_dtype = DType::kInt64) {
  const int64_t N = moe::permute_output_rows(map, num_out, drop_and_pad);
  PermuteOut out;
  out.permuted = Buffer(tokens.dtype, {N, tokens.shape[1]});
  out.indices = Buffer(index_dtype, {N});
  if (probs) out.permuted_probs = Buffer(probs->dtype, {N});
  moe::permute(tokens, map, probs, num_out, drop_and_pad, method, out.permuted, probs ? &out.permuted_probs.view() : nullptr,
               out.indices);
  return out;
}

// Checks a permute result against the oracle order: indices exact, rows and probs bit-exact copies.
void expect_permute_matches_oracle(const Tensor& tokens, const Tensor& map, const Tensor* probs, const PermuteOut& got,
                                   int64_t num_out, bool drop_and_pad) {
  const Slots want = oracle_slots(map, num_out, drop_and_pad);
  const std::vector<int64_t> idx = index_values(got.indices);
  ASSERT_EQ(idx, want.token);
  const int64_t H = tokens.shape[1], E = map.shape[1];
  const size_t row_bytes = static_cast<size_t>(H) * tokens.element_size();
  std::vector<char> zeros(row_bytes, 0);
  for (size_t i = 0; i < idx.size(); ++i) {
    const char* row = static_cast<const char*>(got.permuted.data()) + i * row_bytes;
    const char* want_row = idx[i] < 0 ? zeros.data() : static_cast<const char*>(tokens.data) + static_cast<size_t>(idx[i]) * row_bytes;
    ASSERT_EQ(std::memcmp(row, want_row, row_bytes), 0) << "row " << i;
    if (probs) {
      const double want_p = idx[i] < 0 ? 0.0 : load_as_double(probs->data, probs->dtype, idx[i] * E + want.expert[i]);
      ASSERT_EQ(load_as_double(got.permuted_probs.data(), probs->dtype, static_cast<int64_t>(i)), want_p) << "slot " << i;
    }
  }
}

// float64 oracle of unpermute: out[t] = sum_i x[i] * p_i.
std::vector<double> oracle_unpermute(const Tensor& permuted, const std::vector<int64_t>& idx, const std::vector<double>* p,
                                     int64_t T, std::vector<double>* abs_sum) {
  const int64_t H = permuted.shape[1];
  std::vector<double> out(static_cast<size_t>(T * H), 0.0);
  abs_sum->assign(out.size(), 0.0);
  for (size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const double term = load_as_double(permuted.data, permuted.dtype, static_cast<int64_t>(i) * H + h) * (p ? (*p)[i] : 1.0);
      out[static_cast<size_t>(idx[i] * H + h)] += term;
      (*abs_sum)[static_cast<size_t>(idx[i] * H + h)] += std::abs(term);
    }
  }
  return out;
}

// Tolerance of unpermute against the float64 oracle: each product and each of the (at most
// `terms`) fp32 additions rounds with unit roundoff u32, so the fp32 sum is within
// (terms + 1) * u32 * sum|terms|; the final cast adds u_dtype * |result|, or half the
// subnormal spacing of the dtype for results in its subnormal range (fp16: 2^-25).
void expect_unpermute_close(const Tensor& out, const std::vector<double>& want, const std::vector<double>& abs_sum,
                            int64_t terms) {
  const double u32 = unit_roundoff(DType::kFloat32), u = unit_roundoff(out.dtype);
  const double subnormal_half = out.dtype == DType::kFloat16 ? std::ldexp(1.0, -25)
                                : out.dtype == DType::kBFloat16 ? std::ldexp(1.0, -134)
                                                                : std::ldexp(1.0, -150);
  for (int64_t j = 0; j < out.numel(); ++j) {
    const double got = load_as_double(out.data, out.dtype, j);
    const double w = want[static_cast<size_t>(j)];
    const double tol = (terms + 1) * u32 * abs_sum[static_cast<size_t>(j)] * (1 + u) + u * std::abs(w) + subnormal_half;
    ASSERT_LE(std::abs(got - w), tol) << "element " << j << " got " << got << " want " << w;
  }
}

// ---------------------------------------------------------------- permute grid

TEST(MoePermute, GridMatchesOracleAndPathsAreBitIdentical) {
  std::mt19937_64 rng(test_seed());
  // The grid with T and H kept small enough for a quick (and ASan) run; the
  // T = H = 4096 shape runs once below.
  for (DType dtype : float_dtypes())
    for (int64_t E : {1, 7, 16, 128})
      for (int64_t k : {1, 2, 5, 8}) {
        if (k > E) continue;
        for (int64_t T : {0, 1, 193})
          for (int64_t H : {1, 3, 40}) {
            SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " T=" << T << " E=" << E << " k=" << k << " H=" << H);
            Buffer tokens(dtype, {T, H});
            fill_normal(tokens, rng);
            std::uniform_int_distribution<int64_t> pick(0, E - 1);
            Buffer map = random_map(T, E, k, rng, 0.1, E > 1 ? pick(rng) : -1);
            Buffer probs = random_probs(map, DType::kFloat32, rng);
            const int64_t routed = moe::count_routed(map);
            for (DType idx_dtype : {DType::kInt64, DType::kInt32}) {
              PermuteOut a = run_permute(tokens, map, &probs.view(), std::nullopt, false, Method::kSort, idx_dtype);
              PermuteOut b = run_permute(tokens, map, &probs.view(), routed, false, Method::kFused, idx_dtype);
              expect_permute_matches_oracle(tokens, map, &probs.view(), a, routed, false);
              EXPECT_TRUE(bitwise_equal(a.permuted, b.permuted));
              EXPECT_TRUE(bitwise_equal(a.permuted_probs, b.permuted_probs));
              EXPECT_TRUE(bitwise_equal(a.indices, b.indices));
            }
          }
      }
}

TEST(MoePermute, LargeShapeOnce) {
  std::mt19937_64 rng(test_seed());
  const int64_t T = 4096, E = 16, k = 2, H = 4096;
  Buffer tokens(DType::kBFloat16, {T, H});
  fill_normal(tokens, rng);
  Buffer map = random_map(T, E, k, rng, 0.05, 3);
  Buffer probs = random_probs(map, DType::kFloat32, rng);
  const int64_t routed = moe::count_routed(map);
  PermuteOut a = run_permute(tokens, map, &probs.view(), routed, false, Method::kSort);
  PermuteOut b = run_permute(tokens, map, &probs.view(), routed, false, Method::kFused);
  expect_permute_matches_oracle(tokens, map, &probs.view(), b, routed, false);
  EXPECT_TRUE(bitwise_equal(a.permuted, b.permuted));
  EXPECT_TRUE(bitwise_equal(a.indices, b.indices));
  EXPECT_TRUE(bitwise_equal(a.permuted_probs, b.permuted_probs));
  // And back, both paths bit-identical, against the float64 oracle.
  Buffer out_a(DType::kBFloat16, {T, H}), out_b(DType::kBFloat16, {T, H});
  moe::unpermute(b.permuted, b.indices, out_a, &probs.view(), &map.view(), false, Method::kSort);
  moe::unpermute(b.permuted, b.indices, out_b, &probs.view(), &map.view(), false, Method::kFused);
  EXPECT_TRUE(bitwise_equal(out_a, out_b));
  std::vector<double> p;
  for (int64_t i = 0; i < routed; ++i) p.push_back(load_as_double(b.permuted_probs.data(), DType::kFloat32, i));
  std::vector<double> abs_sum;
  const auto want = oracle_unpermute(b.permuted, index_values(b.indices), &p, T, &abs_sum);
  expect_unpermute_close(out_b, want, abs_sum, k);
}

TEST(MoePermute, NumOutTokensIsEnforced) {
  std::mt19937_64 rng(test_seed());
  const int64_t T = 97, E = 7, k = 2, H = 5;
  Buffer tokens(DType::kFloat32, {T, H});
  fill_normal(tokens, rng);
  Buffer map = random_map(T, E, k, rng, 0.0);
  const int64_t routed = moe::count_routed(map);
  ASSERT_EQ(routed, T * k);
  for (Method method : {Method::kSort, Method::kFused}) {
    // Fewer declared rows than routed pairs: an error, and nothing written.
    Buffer permuted(DType::kFloat32, {routed - 1, H}), indices(DType::kInt64, {routed - 1});
    std::memset(permuted.data(), 0x7f, permuted.nbytes());
    EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, routed - 1, false, method, permuted, nullptr, indices),
                          "num_out_tokens");
    for (int64_t j = 0; j < permuted.numel(); ++j)
      ASSERT_EQ(reinterpret_cast<const uint8_t*>(permuted.data())[j * 4], 0x7f);
    // Output tensor not matching the declared rows.
    Buffer wrong(DType::kFloat32, {routed + 1, H}), wrong_idx(DType::kInt64, {routed + 1});
    EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, routed, false, method, wrong, nullptr, wrong_idx),
                          "permuted");
    // Equal: works. Larger: the tail rows have no source (index -1, zero rows, prob 0).
    for (int64_t extra : {0, 3}) {
      Buffer probs = random_probs(map, DType::kFloat32, rng);
      PermuteOut out = run_permute(tokens, map, &probs.view(), routed + extra, false, method);
      expect_permute_matches_oracle(tokens, map, &probs.view(), out, routed + extra, false);
      // unpermute skips the sourceless rows, with [N] probs and with [T, E] probs.
      Buffer back(DType::kFloat32, {T, H}), back2(DType::kFloat32, {T, H});
      moe::unpermute(out.permuted, out.indices, back, &out.permuted_probs.view(), nullptr, false, method);
      moe::unpermute(out.permuted, out.indices, back2, &probs.view(), &map.view(), false, method);
      EXPECT_TRUE(bitwise_equal(back, back2));
    }
  }
}

TEST(MoePermute, DropAndPadMatchesOracle) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes())
    for (int64_t E : {1, 7, 16})
      for (int64_t k : {1, 2, 5}) {
        if (k > E) continue;
        for (double cf : {0.5, 1.0, 1.3}) {
          const int64_t T = 151, H = 9;
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " E=" << E << " k=" << k << " cf=" << cf);
          Buffer tokens(dtype, {T, H});
          fill_normal(tokens, rng);
          // A router map with capacity (pad_to_capacity), then one with excess routed tokens
          // (drop_and_pad keeps each expert's first `capacity`).
          Buffer logits(DType::kFloat32, {T, E});
          fill_normal(logits, rng);
          moe::RoutingConfig cfg;
          cfg.topk = k;
          cfg.capacity_factor = cf;
          cfg.pad_to_capacity = true;
          Buffer map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E}), tpe(DType::kInt64, {E});
          moe::route(logits, cfg, nullptr, map, probs, tpe);
          const int64_t capacity = std::min(T, moe::expert_capacity(T, E, k, cf));
          Buffer excess = random_map(T, E, k, rng, 0.1, E > 1 ? 0 : -1);
          for (const Buffer* m : {&map, &excess}) {
            const int64_t num_out = E * capacity;
            PermuteOut a = run_permute(tokens, *m, &probs.view(), num_out, true, Method::kSort);
            PermuteOut b = run_permute(tokens, *m, &probs.view(), num_out, true, Method::kFused);
            expect_permute_matches_oracle(tokens, *m, &probs.view(), a, num_out, true);
            EXPECT_TRUE(bitwise_equal(a.permuted, b.permuted));
            EXPECT_TRUE(bitwise_equal(a.indices, b.indices));
            EXPECT_TRUE(bitwise_equal(a.permuted_probs, b.permuted_probs));
            // unpermute with Megatron's [T, E] probs + routing_map form equals the [N] form.
            Buffer back_a(dtype, {T, H}), back_b(dtype, {T, H}), back_c(dtype, {T, H});
            moe::unpermute(a.permuted, a.indices, back_a, &probs.view(), &m->view(), true, Method::kSort);
            moe::unpermute(a.permuted, a.indices, back_b, &probs.view(), &m->view(), true, Method::kFused);
            moe::unpermute(a.permuted, a.indices, back_c, &a.permuted_probs.view(), nullptr, false, Method::kFused);
            EXPECT_TRUE(bitwise_equal(back_a, back_b));
            EXPECT_TRUE(bitwise_equal(back_a, back_c));
          }
        }
      }
}

// ---------------------------------------------------------------- unpermute

// One element's bits (2 or 4 bytes, as stored).
uint32_t element_bits(const void* at, size_t width) {
  if (width == 2) {
    uint16_t v;
    std::memcpy(&v, at, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, at, 4);
  return v;
}

// The bits of +0 + x in x's format: x itself, but +0 for -0 (round to nearest).
uint32_t sum_from_zero_bits(const void* at, size_t width) {
  const uint32_t bits = element_bits(at, width);
  const uint32_t negative_zero = width == 2 ? 0x8000u : 0x80000000u;
  return bits == negative_zero ? 0u : bits;
}

TEST(MoeUnpermute, MatchesFloat64OracleAndPathsAreBitIdentical) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes())
    for (int64_t E : {1, 7, 16, 128})
      for (int64_t k : {1, 2, 5, 8}) {
        if (k > E) continue;
        for (int64_t T : {0, 1, 131})
          for (int64_t H : {1, 3, 33, 80, 600}) {  // 80, 600: every vector loop, two column blocks
            SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " T=" << T << " E=" << E << " k=" << k << " H=" << H);
            Buffer map = random_map(T, E, k, rng, 0.1, E > 1 ? E - 1 : -1);
            const int64_t N = moe::count_routed(map);
            const Slots slots = oracle_slots(map, N, false);
            Buffer permuted(dtype, {N, H});
            fill_normal(permuted, rng);
            Buffer indices = index_buffer(slots.token);
            for (DType prob_dtype : {DType::kFloat32, DType::kBFloat16}) {
              Buffer probs = random_probs(map, prob_dtype, rng);
              Buffer permuted_probs(prob_dtype, {N});
              std::vector<double> p(static_cast<size_t>(N));
              for (int64_t i = 0; i < N; ++i) {
                p[static_cast<size_t>(i)] = load_as_double(probs.data(), prob_dtype, slots.token[static_cast<size_t>(i)] * E + slots.expert[static_cast<size_t>(i)]);
                store_from_double(permuted_probs.data(), prob_dtype, i, p[static_cast<size_t>(i)]);
              }
              std::vector<double> abs_sum;
              const auto want_p = oracle_unpermute(permuted, slots.token, &p, T, &abs_sum);
              Buffer out_sort(dtype, {T, H}), out_fused(dtype, {T, H}), out_map(dtype, {T, H});
              moe::unpermute(permuted, indices, out_sort, &permuted_probs.view(), nullptr, false, Method::kSort);
              moe::unpermute(permuted, indices, out_fused, &permuted_probs.view(), nullptr, false, Method::kFused);
              moe::unpermute(permuted, indices, out_map, &probs.view(), &map.view(), false, Method::kFused);
              expect_unpermute_close(out_fused, want_p, abs_sum, k);
              EXPECT_TRUE(bitwise_equal(out_sort, out_fused));
              EXPECT_TRUE(bitwise_equal(out_map, out_fused));
            }
            // Without probs: the plain sum; a token with one slot comes back bit-exact, but
            // for -0.0: the sum starts at +0 and +0 + -0 is +0, as Megatron's scatter_add
            // into zeros gives (an fp16 normal sample below 2^-25 rounds to -0.0).
            std::vector<double> abs_sum;
            const auto want = oracle_unpermute(permuted, slots.token, nullptr, T, &abs_sum);
            Buffer out_sort(dtype, {T, H}), out_fused(dtype, {T, H});
            moe::unpermute(permuted, indices, out_sort, nullptr, nullptr, false, Method::kSort);
            moe::unpermute(permuted, indices, out_fused, nullptr, nullptr, false, Method::kFused);
            expect_unpermute_close(out_fused, want, abs_sum, k);
            EXPECT_TRUE(bitwise_equal(out_sort, out_fused));
            if (k == 1) {
              const size_t width = permuted.view().element_size();
              for (int64_t i = 0; i < N; ++i)
                for (int64_t h = 0; h < H; ++h) {
                  const size_t at = static_cast<size_t>(i * H + h) * width;
                  const size_t out_at = static_cast<size_t>(slots.token[static_cast<size_t>(i)] * H + h) * width;
                  ASSERT_EQ(element_bits(static_cast<const char*>(out_fused.data()) + out_at, width),
                            sum_from_zero_bits(static_cast<const char*>(permuted.data()) + at, width))
                      << "row " << i << " column " << h;
                }
            }
            // Tokens routed nowhere come back as zero rows.
            std::vector<int64_t> hits(static_cast<size_t>(T), 0);
            for (int64_t t : slots.token) ++hits[static_cast<size_t>(t)];
            for (int64_t t = 0; t < T; ++t)
              if (hits[static_cast<size_t>(t)] == 0) {
                for (int64_t h = 0; h < H; ++h) ASSERT_EQ(load_as_double(out_fused.data(), dtype, t * H + h), 0.0);
              }
          }
      }
}

TEST(MoeUnpermute, SubnormalSumsAreRoundedNotFlushed) {
  // bf16 rows whose weighted sums fall below fp32's normal range in some lanes: each
  // sum is rounded to bf16 as a scalar would round it (the CPU's bf16 conversion reads
  // a subnormal as zero, so those blocks must not go through it), in every lane
  // position of a 32-element block and in the tail.
  std::mt19937_64 rng(test_seed());
  const DType dtype = DType::kBFloat16;
  for (int64_t H : {32, 64, 71}) {
    SCOPED_TRACE(H);
    const int64_t T = 6;
    const EveryTokenRouted routed(T, 4, 2, rng);
    const int64_t N = routed.N;
    const Slots& slots = routed.slots;
    const Buffer& indices = routed.indices;
    Buffer permuted(dtype, {N, H}), probs(DType::kFloat32, {N});
    std::uniform_int_distribution<int> pick(0, 3);
    for (int64_t j = 0; j < N * H; ++j) {
      const double tiny[] = {0x1.8p-128, -0x1p-131, 0x1.4p-127, 1.5};
      store_from_double(permuted.data(), dtype, j, tiny[pick(rng)]);
    }
    for (int64_t i = 0; i < N; ++i) store_from_double(probs.data(), DType::kFloat32, i, 0.75);
    Buffer out(dtype, {T, H});
    moe::unpermute(permuted, indices, out, &probs.view(), nullptr, false, Method::kFused);
    size_t subnormal = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;  // the slots of token t in slot order, each product rounded to fp32
        for (int64_t i = 0; i < N; ++i)
          if (slots.token[static_cast<size_t>(i)] == t)
            acc = acc + static_cast<float>(load_as_double(permuted.data(), dtype, i * H + h)) * 0.75f;
        subnormal += std::fpclassify(acc) == FP_SUBNORMAL;
        ASSERT_EQ(static_cast<const uint16_t*>(out.data())[t * H + h], float_to_bf16(acc)) << "t=" << t << " h=" << h;
      }
    EXPECT_GT(subnormal, 0u);
    // The backward's scaled rows, dpermuted = cast(dy * prob), with dprobs taken in the
    // same pass: the same rule for their subnormal products.
    Buffer dy(dtype, {T, H}), dpermuted(dtype, {N, H}), dprobs(dtype, {N}), bf16_probs(dtype, {N});
    for (int64_t j = 0; j < T * H; ++j) store_from_double(dy.data(), dtype, j, load_as_double(permuted.data(), dtype, j));
    for (int64_t i = 0; i < N; ++i) store_from_double(bf16_probs.data(), dtype, i, 0.75);
    moe::unpermute_backward(dy, permuted, indices, &bf16_probs.view(), nullptr, false, Method::kFused, dpermuted,
                            &dprobs.view());
    subnormal = 0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float scaled =
            static_cast<float>(load_as_double(dy.data(), dtype, slots.token[static_cast<size_t>(i)] * H + h)) * 0.75f;
        subnormal += std::fpclassify(scaled) == FP_SUBNORMAL;
        ASSERT_EQ(static_cast<const uint16_t*>(dpermuted.data())[i * H + h], float_to_bf16(scaled))
            << "i=" << i << " h=" << h;
      }
    EXPECT_GT(subnormal, 0u);
  }
}

// A token's sum starts from +0, as the reference's zeroed accumulators (and torch's
// scatter_add into zeros): slots of -0 (and -0 products, a negative prob times +0) sum
// to +0, on every target, the fused path as the sort path.
TEST(MoeUnpermute, SignedZerosSumFromPositiveZero) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  for (DType dtype : float_dtypes())
    for (int64_t k : {1, 2})
      for (int64_t H : {5, 80}) {
        const int64_t T = 6, E = 3;
        Buffer map = random_map(T, E, k, rng);
        const int64_t N = moe::count_routed(map);
        const Slots slots = oracle_slots(map, N, false);
        Buffer indices = index_buffer(slots.token);
        Buffer permuted(dtype, {N, H}), probs(DType::kFloat32, {N});
        std::uniform_int_distribution<int> sign(0, 1);
        for (int64_t j = 0; j < permuted.numel(); ++j) store_from_double(permuted.data(), dtype, j, sign(rng) ? -0.0 : 0.0);
        for (int64_t i = 0; i < N; ++i) probs.data_as<float>()[i] = sign(rng) ? -0.5f : 0.5f;
        for (int64_t target : targets) {
          SCOPED_TRACE(::testing::Message() << hwy::TargetName(target) << " " << dtype_name(dtype) << " k=" << k
                                            << " H=" << H);
          hwy::SetSupportedTargetsForTest(target);
          for (const Tensor* p : std::initializer_list<const Tensor*>{nullptr, &probs.view()}) {
            Buffer out_sort(dtype, {T, H}), out_fused(dtype, {T, H});
            moe::unpermute(permuted, indices, out_sort, p, nullptr, false, Method::kSort);
            moe::unpermute(permuted, indices, out_fused, p, nullptr, false, Method::kFused);
            EXPECT_TRUE(bitwise_equal(out_sort, out_fused));
            for (int64_t j = 0; j < T * H; ++j) {
              const double v = load_as_double(out_fused.data(), dtype, j);
              ASSERT_TRUE(v == 0.0 && !std::signbit(v)) << "element " << j;
            }
          }
        }
        hwy::SetSupportedTargetsForTest(0);
      }
}

TEST(MoeUnpermute, ResultDoesNotDependOnThreadCount) {
  std::mt19937_64 rng(test_seed());
  const int64_t T = 300, E = 16, k = 5, H = 70;
  Buffer tokens(DType::kBFloat16, {T, H});
  fill_normal(tokens, rng);
  Buffer map = random_map(T, E, k, rng);
  Buffer probs = random_probs(map, DType::kFloat32, rng);
  const int threads = num_threads();
  std::vector<Buffer> outs;
  for (int n : {1, 2, 3}) {
    set_num_threads(n);
    PermuteOut p = run_permute(tokens, map, &probs.view(), std::nullopt, false, Method::kFused);
    outs.emplace_back(DType::kBFloat16, std::vector<int64_t>{T, H});
    moe::unpermute(p.permuted, p.indices, outs.back(), &probs.view(), &map.view(), false, Method::kFused);
  }
  set_num_threads(threads);
  EXPECT_TRUE(bitwise_equal(outs[0], outs[1]));
  EXPECT_TRUE(bitwise_equal(outs[0], outs[2]));
}

// ---------------------------------------------------------------- backward

double dot(const Tensor& a, const std::vector<double>& w) {
  double s = 0;
  for (int64_t j = 0; j < a.numel(); ++j) s += load_as_double(a.data, a.dtype, j) * w[static_cast<size_t>(j)];
  return s;
}

std::vector<double> random_vector(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> d;
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// Finite differences of L = <w, unpermute(x, p)> in float64 along random directions. L is
// linear in x and in p separately, so a central difference has no truncation error: what
// remains is the fp32 rounding of the forward, bounded by ~ (k + 2) * u32 * sum|terms| / step.
TEST(MoeBackward, UnpermuteMatchesFiniteDifferences) {
  std::mt19937_64 rng(test_seed());
  for (bool use_map : {false, true})
    for (bool drop_and_pad : {false, true}) {
      if (drop_and_pad && !use_map) continue;
      const int64_t T = 61, E = 7, k = 3, H = 6;
      SCOPED_TRACE(::testing::Message() << "use_map=" << use_map << " drop_and_pad=" << drop_and_pad);
      Buffer map = random_map(T, E, k, rng);
      const int64_t N = drop_and_pad ? E * 20 : moe::count_routed(map);
      const Slots slots = oracle_slots(map, N, drop_and_pad);
      Buffer indices = index_buffer(slots.token);
      Buffer x(DType::kFloat32, {N, H});
      fill_normal(x, rng);
      Buffer probs_te = random_probs(map, DType::kFloat32, rng);
      Buffer probs_n(DType::kFloat32, {N});
      for (int64_t i = 0; i < N; ++i)
        probs_n.data_as<float>()[i] = slots.token[static_cast<size_t>(i)] < 0 ? 0.0f
            : probs_te.data_as<float>()[slots.token[static_cast<size_t>(i)] * E + slots.expert[static_cast<size_t>(i)]];
      Buffer& probs = use_map ? probs_te : probs_n;
      const Tensor* map_ptr = use_map ? &map.view() : nullptr;
      // Loss weights are fp32 values so that dy = w exactly.
      std::vector<double> w = random_vector(T * H, rng);
      for (auto& x : w) x = static_cast<float>(x);

      auto loss = [&](const Tensor& xx, const Tensor& pp) {
        Buffer y(DType::kFloat32, {T, H});
        moe::unpermute(xx, indices, y, &pp, map_ptr, drop_and_pad, Method::kFused);
        return dot(y, w);
      };
      Buffer dy(DType::kFloat32, {T, H});
      for (int64_t j = 0; j < T * H; ++j) dy.data_as<float>()[j] = static_cast<float>(w[static_cast<size_t>(j)]);
      Buffer dx_sort(DType::kFloat32, {N, H}), dx(DType::kFloat32, {N, H});
      Buffer dp_sort(DType::kFloat32, probs.view().ndim == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{T, E});
      Buffer dp(DType::kFloat32, probs.view().ndim == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{T, E});
      moe::unpermute_backward(dy, x, indices, &probs.view(), map_ptr, drop_and_pad, Method::kSort, dx_sort, &dp_sort.view());
      moe::unpermute_backward(dy, x, indices, &probs.view(), map_ptr, drop_and_pad, Method::kFused, dx, &dp.view());
      EXPECT_TRUE(bitwise_equal(dx_sort, dx));
      EXPECT_TRUE(bitwise_equal(dp_sort, dp));

      double abs_terms = 0;
      for (int64_t i = 0; i < N; ++i)
        for (int64_t h = 0; h < H; ++h) abs_terms += std::abs(x.data_as<float>()[i * H + h]) * 3.0;
      const double step = 0.5;
      for (int trial = 0; trial < 3; ++trial) {
        // Direction in x (dyadic values: x +- step*v stays exact in fp32 for these magnitudes).
        Buffer v(DType::kFloat32, {N, H}), xp(DType::kFloat32, {N, H}), xm(DType::kFloat32, {N, H});
        std::uniform_int_distribution<int> coin(-2, 2);
        double predicted = 0;
        for (int64_t j = 0; j < N * H; ++j) {
          const float vj = static_cast<float>(coin(rng)) * 0.25f;
          xp.data_as<float>()[j] = x.data_as<float>()[j] + static_cast<float>(step) * vj;
          xm.data_as<float>()[j] = x.data_as<float>()[j] - static_cast<float>(step) * vj;
          predicted += static_cast<double>(dx.data_as<float>()[j]) * vj;
        }
        const double fd = (loss(xp, probs) - loss(xm, probs)) / (2 * step);
        const double tol = 1e-5 * (abs_terms + std::abs(predicted)) / step + 1e-6;
        EXPECT_NEAR(fd, predicted, tol) << "d/dx trial " << trial;
        // Direction in probs.
        Buffer pp(DType::kFloat32, probs.view().ndim == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{T, E});
        Buffer pm(DType::kFloat32, probs.view().ndim == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{T, E});
        double predicted_p = 0;
        for (int64_t j = 0; j < probs.numel(); ++j) {
          const float vj = static_cast<float>(coin(rng)) * 0.25f;
          pp.data_as<float>()[j] = probs.data_as<float>()[j] + static_cast<float>(step) * vj;
          pm.data_as<float>()[j] = probs.data_as<float>()[j] - static_cast<float>(step) * vj;
          predicted_p += static_cast<double>(dp.data_as<float>()[j]) * vj;
        }
        const double fd_p = (loss(x, pp) - loss(x, pm)) / (2 * step);
        EXPECT_NEAR(fd_p, predicted_p, 1e-5 * (abs_terms + std::abs(predicted_p)) / step + 1e-6) << "d/dp trial " << trial;
      }
    }
}

// Unpermute's backward row at widths around every SIMD width (the vector loop, the
// zero-padded tail, and a row shorter than one vector), every dtype: dpermuted is the
// fp32 product dy * prob rounded once more to the dtype (exactly, as the oracle
// computes it), dprobs the double sum of dy * x rounded once to the probs' dtype.
// Bound for dprobs: half an ulp of the output dtype at the value, plus the double
// sum's own error (H products, each exact: under H * 2^-53 of the sum of |terms|).
TEST(MoeBackward, UnpermuteRowsMatchFloat64OracleAtOddWidths) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes())
    for (int64_t H : {1, 5, 8, 15, 16, 17, 31, 33, 64, 257}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " H=" << H);
      const int64_t T = 9, E = 4, k = 2;
      Buffer map = random_map(T, E, k, rng);
      const int64_t N = moe::count_routed(map);
      const Slots slots = oracle_slots(map, N, false);
      Buffer indices = index_buffer(slots.token);
      Buffer x(dtype, {N, H}), dy(dtype, {T, H});
      fill_normal(x, rng);
      fill_normal(dy, rng);
      Buffer probs(dtype, {N});
      fill_normal(probs, rng);
      Buffer dx_sort(dtype, {N, H}), dx(dtype, {N, H}), dp_sort(dtype, {N}), dp(dtype, {N});
      moe::unpermute_backward(dy, x, indices, &probs.view(), nullptr, false, Method::kSort, dx_sort, &dp_sort.view());
      moe::unpermute_backward(dy, x, indices, &probs.view(), nullptr, false, Method::kFused, dx, &dp.view());
      EXPECT_TRUE(bitwise_equal(dx_sort, dx));
      EXPECT_TRUE(bitwise_equal(dp_sort, dp));
      const double ulp = dtype == DType::kFloat32 ? 0x1p-24 : dtype == DType::kFloat16 ? 0x1p-11 : 0x1p-8;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t t = slots.token[static_cast<size_t>(i)];
        const float prob = static_cast<float>(load_as_double(probs.data(), dtype, i));
        double sum = 0, abs_terms = 0;
        for (int64_t h = 0; h < H; ++h) {
          const double a = load_as_double(dy.data(), dtype, t * H + h), b = load_as_double(x.data(), dtype, i * H + h);
          sum += a * b;
          abs_terms += std::abs(a * b);
          Buffer want(dtype, {1});
          store_from_double(want.data(), dtype, 0, static_cast<float>(static_cast<float>(a) * prob));
          ASSERT_EQ(load_as_double(dx.data(), dtype, i * H + h), load_as_double(want.data(), dtype, 0))
              << "slot " << i << " h " << h;
        }
        const double got = load_as_double(dp.data(), dtype, i);
        EXPECT_LE(std::abs(got - sum), std::abs(sum) * ulp + abs_terms * static_cast<double>(H) * 0x1p-53 + 1e-300)
            << "slot " << i;
      }
    }
}

// unpermute_backward's dprobs in the one order every target keeps: per slot, 16
// partial sums of dy[t][h] * x[i][h] in double (h mod 16, increasing h), then the
// pairwise tree, rounded once to the dtype.
Buffer dprobs_in_one_order(const Buffer& dy, const Buffer& x, const Slots& slots, DType dtype) {
  const int64_t N = x.view().shape[0], H = x.view().shape[1];
  Buffer want(dtype, {N});
  for (int64_t i = 0; i < N; ++i) {
    double partial[16] = {};
    const int64_t t = slots.token[static_cast<size_t>(i)];
    for (int64_t h = 0; h < H; ++h)
      partial[h % 16] += load_as_double(dy.data(), dtype, t * H + h) * load_as_double(x.data(), dtype, i * H + h);
    for (int w = 1; w < 16; w *= 2)
      for (int j = 0; j + w < 16; j += 2 * w) partial[j] += partial[j + w];
    store_from_double(want.data(), dtype, i, partial[0]);
  }
  return want;
}

// unpermute_backward's dprobs on every compiled Highway target, each bitwise `want`.
void expect_dprobs_on_every_target(const Buffer& dy, const Buffer& x, const Buffer& indices, const Buffer& probs,
                                   const Buffer& want) {
  const DType dtype = x.view().dtype;
  const int64_t N = x.view().shape[0], H = x.view().shape[1];
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(::testing::Message() << hwy::TargetName(target) << " " << dtype_name(dtype) << " H=" << H);
    hwy::SetSupportedTargetsForTest(target);
    Buffer dx(dtype, {N, H}), dp(probs.view().dtype, {N});
    moe::unpermute_backward(dy, x, indices, &probs.view(), nullptr, false, Method::kFused, dx, &dp.view());
    EXPECT_TRUE(bitwise_equal(dp, want));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// dprobs of unpermute's backward has one order of additions on every SIMD target: 16
// partial sums over h = j (mod 16) in increasing h, then a pairwise tree (this test's own
// copy of the order), the double result rounded once to the probs' dtype. Each target
// this build runs (on aarch64 under qemu: NEON and SVE) gives those bits, so the
// architectures' digests agree by construction, not by the luck of the seeds.
TEST(MoeBackward, UnpermuteDprobsHaveOneOrderOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (int64_t H : {1, 15, 16, 17, 40, 255}) {
      const int64_t T = 7, E = 3, k = 2;
      Buffer map = random_map(T, E, k, rng);
      const int64_t N = moe::count_routed(map);
      const Slots slots = oracle_slots(map, N, false);
      Buffer indices = index_buffer(slots.token);
      Buffer x(dtype, {N, H}), dy(dtype, {T, H}), probs(dtype, {N});
      // Powers of two from 2^-30 to 2^30 with random signs: products span 2^120, so
      // cancellations make the double sum depend on its order (a lane-width order
      // would give other bits here).
      std::uniform_int_distribution<int> exponent(-30, 30), sign(0, 1);
      for (Buffer* b : {&x, &dy})
        for (int64_t j = 0; j < b->numel(); ++j)
          store_from_double(b->data(), dtype, j, std::ldexp(sign(rng) ? 1.0 : -1.0, exponent(rng)));
      fill_normal(probs, rng);
      if (H > 8 && N > 0) {  // slot 0: products 2^60, 1, -2^60 at h = 0, 1, 8: this order gives 0
        const int64_t t = slots.token[0];
        for (int64_t h = 0; h < H; ++h) {
          const double d = h == 0 ? 0x1p30 : h == 1 ? 1.0 : h == 8 ? -0x1p30 : 0.0;
          store_from_double(dy.data(), dtype, t * H + h, d);
          store_from_double(x.data(), dtype, h, h == 8 ? 0x1p30 : std::fabs(d));
        }
      }
      const Buffer want = dprobs_in_one_order(dy, x, slots, dtype);
      expect_dprobs_on_every_target(dy, x, indices, probs, want);
    }
}

// bf16 rows take their products in fp32, exact there only inside fp32's normal range;
// a row with a product beyond it must still give the bits of the one order in double.
// Each row below has normal products everywhere else, so one check alone decides it:
// row 0: +2^140 and -2^140 cancel, then ones (fp32 products: inf - inf, NaN); row 1:
// one product of -2^-160, then +-2^-120 that cancel (fp32 makes the first +0 and the
// sum +0, double keeps -2^-160, which rounds to -0); row 2: a bf16 subnormal factor
// (a subnormal product); row 3: a zero factor (an exact zero, which keeps the fp32
// sums). The other rows: random normal products.
TEST(MoeBackward, UnpermuteDprobsKeepTheOrderBeyondFp32Range) {
  std::mt19937_64 rng(test_seed());
  const DType dtype = DType::kBFloat16;
  for (int64_t H : {17, 33, 49, 255}) {  // H - 1 even: row 1's +-2^-120 pair up
    const int64_t T = 9;
    const EveryTokenRouted routed(T, 4, 2, rng);
    const int64_t N = routed.N;
    const Slots& slots = routed.slots;
    const Buffer& indices = routed.indices;
    Buffer x(dtype, {N, H}), dy(dtype, {T, H}), probs(dtype, {N});
    fill_normal(x, rng);
    fill_normal(dy, rng);
    fill_normal(probs, rng);
    // One slot of each of 4 distinct tokens (a token's dy is shared by its slots).
    std::vector<int64_t> rows;
    std::vector<bool> used(static_cast<size_t>(T), false);
    for (int64_t i = 0; i < N && rows.size() < 4; ++i)
      if (!used[static_cast<size_t>(slots.token[static_cast<size_t>(i)])]) {
        used[static_cast<size_t>(slots.token[static_cast<size_t>(i)])] = true;
        rows.push_back(i);
      }
    ASSERT_EQ(rows.size(), 4u);
    // Row i's dy and x at h: `pair(h)` = (dy, x).
    auto set_row = [&](int64_t i, auto pair) {
      const int64_t t = slots.token[static_cast<size_t>(i)];
      for (int64_t h = 0; h < H; ++h) {
        const auto [d, v] = pair(h);
        store_from_double(dy.data(), dtype, t * H + h, d);
        store_from_double(x.data(), dtype, i * H + h, v);
      }
    };
    set_row(rows[0], [](int64_t h) {
      return h == 0 ? std::pair(0x1p70, 0x1p70) : h == 1 ? std::pair(-0x1p70, 0x1p70) : std::pair(1.0, 1.0);
    });
    set_row(rows[1], [](int64_t h) {
      return h == 0 ? std::pair(-0x1p-80, 0x1p-80) : std::pair(h % 2 ? 0x1p-60 : -0x1p-60, 0x1p-60);
    });
    set_row(rows[2], [](int64_t h) { return std::pair(1.0 + static_cast<double>(h % 7) / 8, h == 3 ? 0x1p-130 : 1.5); });
    set_row(rows[3], [](int64_t h) { return std::pair(-1.5 + static_cast<double>(h % 5) / 4, h == 5 ? 0.0 : 0.75); });
    const Buffer want = dprobs_in_one_order(dy, x, slots, dtype);
    // The ones that meet +-2^140 in a partial sum vanish there, the rest count: finite.
    ASSERT_TRUE(std::isfinite(load_as_double(want.data(), dtype, rows[0])));
    ASSERT_GT(load_as_double(want.data(), dtype, rows[0]), 0.0);
    ASSERT_EQ(load_as_double(want.data(), dtype, rows[1]), 0.0);
    ASSERT_TRUE(std::signbit(load_as_double(want.data(), dtype, rows[1])));
    expect_dprobs_on_every_target(dy, x, indices, probs, want);
  }
}

TEST(MoeBackward, UnpermuteDprobsKeepTheTreeOrderOnRowsOfWholeVectors) {
  // Rows of whole 32-element steps end in the tree alone (the AVX-512 kernel reduces
  // it in registers). Products of +-2^60 in partials 0 and 4 absorb the 1s beside
  // them: the tree's ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) gives 0 there,
  // and the 1s of partials 8-15 survive (8 * H/16); any other pairing gives another
  // sum (0, or the 1s of other partials). Every product is exact in fp32.
  constexpr DType dtype = DType::kBFloat16;
  constexpr int64_t T = 5;
  std::mt19937_64 rng(test_seed());
  for (int64_t H : {32, 64, 256}) {
    const EveryTokenRouted routed(T, 4, 2, rng);
    const int64_t N = routed.N;
    Buffer probs(dtype, {N});
    fill_normal(probs, rng);
    Buffer x(dtype, {N, H}), dy(dtype, {T, H});  // every element set below
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        store_from_double(dy.data(), dtype, t * H + h, h % 16 == 0 ? 0x1p30 : h % 16 == 4 ? -0x1p30 : 1.0);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h)
        store_from_double(x.data(), dtype, i * H + h, h % 16 == 0 || h % 16 == 4 ? 0x1p30 : 1.0);
    const Buffer want = dprobs_in_one_order(dy, x, routed.slots, dtype);
    for (int64_t i = 0; i < N; ++i) ASSERT_EQ(load_as_double(want.data(), dtype, i), 8.0 * static_cast<double>(H / 16));
    expect_dprobs_on_every_target(dy, x, routed.indices, probs, want);
  }
}

// Backward of permute: dtokens = scatter-add of dpermuted (float64 oracle), dprobs = scatter of
// dpermuted_probs; and both are the adjoints of the forward gather (checked as <dy, P x> == <P^T dy, x>).
TEST(MoeBackward, PermuteIsAdjointOfGather) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes())
    for (bool drop_and_pad : {false, true}) {
      const int64_t T = 83, E = 16, k = 5, H = 7;
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " drop_and_pad=" << drop_and_pad);
      Buffer map = random_map(T, E, k, rng);
      const int64_t N = drop_and_pad ? E * 30 : moe::count_routed(map);
      Buffer tokens(dtype, {T, H});
      fill_normal(tokens, rng);
      Buffer probs = random_probs(map, DType::kFloat32, rng);
      PermuteOut fwd = run_permute(tokens, map, &probs.view(), N, drop_and_pad, Method::kFused);
      Buffer dpermuted(dtype, {N, H}), dpp(DType::kFloat32, {N});
      fill_normal(dpermuted, rng);
      fill_normal(dpp, rng);
      Buffer dtokens_sort(dtype, {T, H}), dtokens(dtype, {T, H}), dprobs(DType::kFloat32, {T, E});
      moe::permute_backward(dpermuted, fwd.indices, dtokens_sort, Method::kSort);
      moe::permute_backward(dpermuted, fwd.indices, dtokens, Method::kFused);
      EXPECT_TRUE(bitwise_equal(dtokens_sort, dtokens));
      moe::permute_probs_backward(dpp, fwd.indices, map, drop_and_pad, dprobs);

      std::vector<double> abs_sum;
      const auto want = oracle_unpermute(dpermuted, index_values(fwd.indices), nullptr, T, &abs_sum);
      expect_unpermute_close(dtokens, want, abs_sum, drop_and_pad ? E : k);
      // <dpermuted, P tokens> == <P^T dpermuted, tokens> in float64 (exact gather both sides,
      // P^T dpermuted compared through the float64 oracle `want`).
      double lhs = 0, rhs = 0, scale = 0;
      for (int64_t j = 0; j < N * H; ++j) {
        const double a = load_as_double(dpermuted.data(), dtype, j) * load_as_double(fwd.permuted.data(), dtype, j);
        lhs += a;
        scale += std::abs(a);
      }
      for (int64_t j = 0; j < T * H; ++j) rhs += want[static_cast<size_t>(j)] * load_as_double(tokens.data(), dtype, j);
      EXPECT_NEAR(lhs, rhs, 1e-12 * scale + 1e-12);
      double lhs_p = 0, rhs_p = 0;
      for (int64_t i = 0; i < N; ++i) lhs_p += static_cast<double>(dpp.data_as<float>()[i]) * fwd.permuted_probs.data_as<float>()[i];
      for (int64_t j = 0; j < T * E; ++j) rhs_p += static_cast<double>(dprobs.data_as<float>()[j]) * probs.data_as<float>()[j];
      EXPECT_NEAR(lhs_p, rhs_p, 1e-5 * (std::abs(lhs_p) + 1));
    }
}

// ---------------------------------------------------------------- empty and degenerate

TEST(MoeEdgeCases, EmptyTokensAndNobodyRouted) {
  for (Method method : {Method::kSort, Method::kFused}) {
    // T = 0.
    Buffer tokens(DType::kBFloat16, {0, 8}), map(DType::kBool, {0, 4}), probs(DType::kFloat32, {0, 4});
    PermuteOut out = run_permute(tokens, map, &probs.view(), std::nullopt, false, method);
    EXPECT_EQ(out.permuted.numel(), 0);
    Buffer back(DType::kBFloat16, {0, 8});
    moe::unpermute(out.permuted, out.indices, back, &probs.view(), &map.view(), false, method);
    PermuteOut padded = run_permute(tokens, map, &probs.view(), 0, true, method);
    EXPECT_EQ(padded.permuted.numel(), 0);
    // Nobody routed: zero rows out, zeros back.
    Buffer tokens2(DType::kFloat32, {5, 3}), map2(DType::kBool, {5, 4}), back2(DType::kFloat32, {5, 3});
    std::mt19937_64 rng(1);
    fill_normal(tokens2, rng);
    PermuteOut none = run_permute(tokens2, map2, nullptr, std::nullopt, false, method);
    EXPECT_EQ(none.permuted.numel(), 0);
    moe::unpermute(none.permuted, none.indices, back2, nullptr, nullptr, false, method);
    for (int64_t j = 0; j < back2.numel(); ++j) EXPECT_EQ(back2.data_as<float>()[j], 0.0f);
  }
}

// ---------------------------------------------------------------- 64-bit indexing

// Row offsets beyond 2^31 elements without allocating them: a virtual (never touched)
// mapping of T * H > 2^31 fp16 elements, where only the last row is routed / read.
TEST(MoeIndexing, OffsetsBeyond2To31Elements) {
  const int64_t H = 1024, T = (int64_t{1} << 21) + 3;  // T * H = 2^31 + 3072 elements
  static_assert(sizeof(size_t) == 8);
  const size_t bytes = static_cast<size_t>(T * H) * 2;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  uint16_t* data = static_cast<uint16_t*>(mem);
  const int64_t last = T - 1;
  for (int64_t h = 0; h < H; ++h) data[last * H + h] = float_to_half(static_cast<float>(h % 97) - 48.0f);
  Tensor big(mem, DType::kFloat16, {T, H});
  {
    // permute: the one routed pair is the last token.
    Buffer map(DType::kBool, {T, 2});
    map.data_as<uint8_t>()[last * 2 + 1] = 1;
    // Fused only: the reference stable-sorts E * T = 4M keys, too slow for the ASan run.
    PermuteOut out = run_permute(big, map, nullptr, std::nullopt, false, Method::kFused);
    ASSERT_EQ(out.permuted.numel(), H);
    EXPECT_EQ(out.indices.data_as<int64_t>()[0], last);
    EXPECT_EQ(std::memcmp(out.permuted.data(), data + last * H, static_cast<size_t>(H) * 2), 0);
  }
  {
    // unpermute: T rows of permuted, all sourceless (-1) except the last, into one token.
    std::vector<int64_t> idx(static_cast<size_t>(T), -1);
    idx.back() = 0;
    Buffer indices = index_buffer(idx);
    Buffer out(DType::kFloat16, {1, H});
    for (Method method : {Method::kSort, Method::kFused}) {
      moe::unpermute(big, indices, out, nullptr, nullptr, false, method);
      EXPECT_EQ(std::memcmp(out.data(), data + last * H, static_cast<size_t>(H) * 2), 0) << moe::method_name(method);
    }
  }
  munmap(mem, bytes);
}

// ---------------------------------------------------------------- bad input

TEST(MoeErrors, BadInputIsRejectedWithNamedArguments) {
  Buffer tokens(DType::kFloat32, {4, 3}), map(DType::kBool, {4, 2}), probs(DType::kFloat32, {4, 2});
  map.data_as<uint8_t>()[0] = 1;
  map.data_as<uint8_t>()[3] = 1;
  Buffer permuted(DType::kFloat32, {2, 3}), pprobs(DType::kFloat32, {2}), idx(DType::kInt64, {2});
  const Method m = Method::kFused;
  Buffer tokens_bad(DType::kFloat32, {5, 3});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens_bad, map, nullptr, 2, false, m, permuted, nullptr, idx), "'tokens'");
  Buffer probs_bad(DType::kFloat32, {4, 3});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, &probs_bad.view(), 2, false, m, permuted, &pprobs.view(), idx), "'probs'");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, &probs.view(), 2, false, m, permuted, nullptr, idx), "'permuted_probs'");
  Buffer map_int(DType::kUInt8, {4, 2});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map_int, nullptr, 2, false, m, permuted, nullptr, idx), "'routing_map'");
  Buffer permuted_bf16(DType::kBFloat16, {2, 3});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 2, false, m, permuted_bf16, nullptr, idx), "'permuted'");
  Buffer idx_float(DType::kFloat32, {2});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 2, false, m, permuted, nullptr, idx_float), "'sorted_indices'");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 1, false, m, permuted, nullptr, idx), "'permuted'");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, -1, false, m, permuted, nullptr, idx), "'num_out_tokens'");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, std::nullopt, true, m, permuted, nullptr, idx), "'num_out_tokens'");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 3, true, m, permuted, nullptr, idx), "multiple of E");
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 10, true, m, permuted, nullptr, idx), "capacity");
  // Output aliasing an input.
  Tensor alias(tokens.data(), DType::kFloat32, {2, 3});
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 2, false, m, alias, nullptr, idx), "overlap");
  EXPECT_LEANSTEP_ERROR(moe::method_from_name("radix"), "'method'");

  // unpermute: indices out of range, probs of the wrong form, shapes.
  Buffer out(DType::kFloat32, {4, 3});
  Buffer bad_idx = index_buffer({0, 4});
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted, bad_idx, out, nullptr, nullptr, false, m), "'sorted_indices'");
  Buffer neg_idx = index_buffer({0, -2});
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted, neg_idx, out, nullptr, nullptr, false, m), "[-1, T=4)");
  Buffer good_idx = index_buffer({0, 1});
  Buffer probs3(DType::kFloat32, {3});
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted, good_idx, out, &probs3.view(), nullptr, false, m), "'probs'");
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted, good_idx, out, &probs_bad.view(), &map.view(), false, m), "'probs'");
  Buffer out_bad(DType::kFloat32, {4, 2});
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted, good_idx, out_bad, nullptr, nullptr, false, m), "'out'");
  Buffer three_idx = index_buffer({0, 1, 2});
  Buffer permuted3(DType::kFloat32, {3, 3});
  // [T, E] probs need exactly one slot per routed pair (2 routed here, 3 slots, last not -1).
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted3, three_idx, out, &probs.view(), &map.view(), false, m), "-1 beyond");
  EXPECT_LEANSTEP_ERROR(moe::unpermute(permuted3, three_idx, out, &probs.view(), &map.view(), true, m), "E * capacity");
  EXPECT_LEANSTEP_ERROR(moe::permute_backward(permuted, bad_idx, out, m), "permute_backward: argument 'sorted_indices'");
  EXPECT_LEANSTEP_ERROR(moe::permute_backward(permuted, good_idx, out_bad, m), "'dtokens'");
  Buffer dpermuted(DType::kFloat32, {2, 3}), dp(DType::kFloat32, {2});
  EXPECT_LEANSTEP_ERROR(moe::unpermute_backward(out, permuted, good_idx, nullptr, nullptr, false, m, dpermuted, &dp.view()),
                        "'dprobs'");
  // int32 indices are fine below 2^31.
  Buffer idx32(DType::kInt32, {2});
  moe::permute(tokens, map, nullptr, 2, false, m, permuted, nullptr, idx32);
  EXPECT_EQ(idx32.data_as<int32_t>()[0], 0);
  EXPECT_EQ(idx32.data_as<int32_t>()[1], 1);
}

}  // namespace
// The rules on metadata (moe::check_*_args), as the device backends call them:
// views of device memory at addresses no host code may read (a read would fault).
// They take what the kernels take and refuse what the kernels refuse, by name.
TEST(MoeErrors, MetadataChecksReadNoTensorMemory) {
  const Device gpu{DeviceType::kCUDA, 0};
  uintptr_t next = uintptr_t{1} << 60;  // beyond every user address space: a read faults
  auto view = [&](DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t(reinterpret_cast<void*>(next), dtype, shape, gpu);
    next += uintptr_t{1} << 40;
    return t;
  };
  const Tensor tokens = view(DType::kFloat32, {4, 3}), map = view(DType::kBool, {4, 2});
  const Tensor probs = view(DType::kFloat32, {4, 2});
  const Tensor permuted = view(DType::kFloat32, {5, 3}), pprobs = view(DType::kFloat32, {5});
  const Tensor idx = view(DType::kInt64, {5});
  moe::check_permute_args(tokens, map, &probs, 5, false, permuted, &pprobs, idx);
  moe::check_permute_args(tokens, map, &probs, std::nullopt, false, permuted, &pprobs, idx);  // rows: the outputs'
  EXPECT_LEANSTEP_ERROR(moe::check_permute_args(tokens, map, &probs, 4, false, permuted, &pprobs, idx),
                        "permute: argument 'permuted' must have shape [4, 3]");
  EXPECT_LEANSTEP_ERROR(moe::check_permute_args(tokens, map, &probs, 5, true, permuted, &pprobs, idx),
                        "multiple of E=2");
  EXPECT_LEANSTEP_ERROR(moe::check_permute_args(tokens, map, nullptr, 5, false, permuted, &pprobs, idx),
                        "'permuted_probs' must be given exactly when probs is given");
  EXPECT_LEANSTEP_ERROR(moe::check_permute_args(tokens, view(DType::kUInt8, {4, 2}), nullptr, 5, false, permuted,
                                                nullptr, idx),
                        "'routing_map' must have dtype");
  const Tensor alias(tokens.data, DType::kFloat32, {5, 3}, gpu);
  EXPECT_LEANSTEP_ERROR(moe::check_permute_args(tokens, map, nullptr, 5, false, alias, nullptr, idx), "overlap");

  const Tensor out = view(DType::kFloat32, {4, 3});
  moe::check_unpermute_args(permuted, idx, out, &probs, &map, false);
  moe::check_unpermute_args(permuted, idx, out, &pprobs, nullptr, false);
  EXPECT_LEANSTEP_ERROR(moe::check_unpermute_args(permuted, idx, out, &probs, &map, true),
                        "'sorted_indices' must have E * capacity entries");
  EXPECT_LEANSTEP_ERROR(moe::check_unpermute_args(permuted, view(DType::kInt64, {4}), out, nullptr, nullptr, false),
                        "'sorted_indices' must have shape [5]");
  moe::check_permute_backward_args(permuted, idx, out);
  EXPECT_LEANSTEP_ERROR(moe::check_permute_backward_args(permuted, idx, view(DType::kFloat16, {4, 3})),
                        "permute_backward: argument 'dtokens'");
  const Tensor dprobs = view(DType::kFloat32, {4, 2});
  moe::check_permute_probs_backward_args(pprobs, idx, map, false, dprobs);
  EXPECT_LEANSTEP_ERROR(moe::check_permute_probs_backward_args(pprobs, idx, map, true, dprobs), "E * capacity");
  const Tensor dpermuted = view(DType::kFloat32, {5, 3});
  moe::check_unpermute_backward_args(out, permuted, idx, &probs, &map, false, dpermuted, &dprobs);
  EXPECT_LEANSTEP_ERROR(moe::check_unpermute_backward_args(out, permuted, idx, nullptr, nullptr, false, dpermuted,
                                                           &dprobs),
                        "'dprobs' needs probs");
  moe::check_pad_routing_map_args(map, 4, map);  // in place
  moe::check_pad_routing_map_args(map, 4, view(DType::kBool, {4, 2}));
  EXPECT_LEANSTEP_ERROR(moe::check_pad_routing_map_args(map, 0, view(DType::kBool, {4, 2})), "'multiple' must be >= 1");
  const Tensor sizes = view(DType::kInt64, {3}), order = view(DType::kInt32, {3});
  const Tensor chunk_probs = view(DType::kFloat32, {4}), chunk_out_probs = view(DType::kFloat32, {4});
  moe::check_sort_chunks_by_idxs_args(tokens, sizes, order, view(DType::kFloat32, {4, 3}), &chunk_probs,
                                      &chunk_out_probs);
  EXPECT_LEANSTEP_ERROR(moe::check_sort_chunks_by_idxs_args(tokens, sizes, order, view(DType::kFloat32, {4, 3}),
                                                            &chunk_probs, nullptr),
                        "'out_probs' must be given exactly when probs is given");
  EXPECT_LEANSTEP_ERROR(moe::check_sort_chunks_by_idxs_args(tokens, sizes, view(DType::kInt64, {2}),
                                                            view(DType::kFloat32, {4, 3}), nullptr, nullptr),
                        "'sorted_idxs' must have shape [3]");
  // The kernels themselves still take host memory only.
  EXPECT_LEANSTEP_ERROR(moe::permute(tokens, map, nullptr, 5, false, Method::kFused, permuted, nullptr, idx),
                        "permute: argument 'tokens' lives on cuda");
}

}  // namespace leanstep::testing
