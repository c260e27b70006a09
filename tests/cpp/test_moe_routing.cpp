// MoE routing (top-k scoring, capacity dropping, padding to capacity), routing-map
// padding and chunk sorting, against oracles written from the semantics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "leanstep/buffer.h"
#include "leanstep/moe.h"
#include "moe_util.h"
#include "test_util.h"

namespace leanstep::testing {
namespace {

using moe::DropPolicy;
using moe::Method;
using moe::RoutingConfig;
using moe::ScoreFunction;

struct Routed {
  Buffer map, probs, tokens_per_expert;
};

Routed run_route(const Tensor& logits, const RoutingConfig& cfg, const Tensor* bias = nullptr) {
  const int64_t T = logits.shape[0], E = logits.shape[1];
  Routed r{Buffer(DType::kBool, {T, E}), Buffer(DType::kFloat32, {T, E}), Buffer(DType::kInt64, {E})};
  moe::route(logits, cfg, bias, r.map, r.probs, r.tokens_per_expert);
  return r;
}

// float64 oracle of the scoring and top-k of one token. Returns false when the k-th and
// (k+1)-th ranking scores are so close (relative 1e-5) that fp32 rounding may legitimately
// order them differently: the selection is then not compared.
bool oracle_token(const std::vector<double>& x, const RoutingConfig& cfg, const std::vector<double>& bias,
                  std::vector<int64_t>* chosen, std::vector<double>* p) {
  const int64_t E = static_cast<int64_t>(x.size()), k = cfg.topk;
  std::vector<double> score(x.size()), rank(x.size());
  if (cfg.score_function == ScoreFunction::kSoftmax) {
    const double m = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(x[static_cast<size_t>(e)] - m);
    for (int64_t e = 0; e < E; ++e) score[static_cast<size_t>(e)] = std::exp(x[static_cast<size_t>(e)] - m) / sum;
    rank = cfg.pre_softmax ? score : x;
  } else {
    for (int64_t e = 0; e < E; ++e) {
      score[static_cast<size_t>(e)] = 1.0 / (1.0 + std::exp(-x[static_cast<size_t>(e)]));
      rank[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] + (bias.empty() ? 0.0 : bias[static_cast<size_t>(e)]);
    }
  }
  std::vector<int64_t> order(x.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return rank[static_cast<size_t>(a)] > rank[static_cast<size_t>(b)]; });
  chosen->assign(order.begin(), order.begin() + k);
  p->clear();
  if (cfg.score_function == ScoreFunction::kSoftmax && !cfg.pre_softmax) {
    const double m = x[static_cast<size_t>(order[0])];
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(x[static_cast<size_t>(order[static_cast<size_t>(j)])] - m);
    for (int64_t j = 0; j < k; ++j) p->push_back(std::exp(x[static_cast<size_t>(order[static_cast<size_t>(j)])] - m) / sum);
  } else {
    for (int64_t j = 0; j < k; ++j) p->push_back(score[static_cast<size_t>(order[static_cast<size_t>(j)])]);
  }
  const bool normalize = cfg.normalize.value_or(cfg.score_function == ScoreFunction::kSigmoid && k > 1);
  if (normalize) {
    const double sum = std::accumulate(p->begin(), p->end(), 0.0);
    for (auto& v : *p) v /= (sum + 1e-20);
  }
  if (cfg.scaling_factor)
    for (auto& v : *p) v *= *cfg.scaling_factor;
  if (k == E) return true;
  const double a = rank[static_cast<size_t>(order[static_cast<size_t>(k - 1)])];
  const double b = rank[static_cast<size_t>(order[static_cast<size_t>(k)])];
  return a != b ? std::abs(a - b) > 1e-5 * std::max(std::abs(a), std::abs(b)) : true;  // exact ties: lower index, as here
}

TEST(MoeRouting, TopKScoringMatchesFloat64Oracle) {
  std::mt19937_64 rng(test_seed());
  const double u32 = unit_roundoff(DType::kFloat32);
  int compared = 0;
  for (DType dtype : float_dtypes())
    for (int64_t E : {1, 7, 16, 128})
      for (int64_t k : {1, 2, 5, 8}) {
        if (k > E) continue;
        for (int variant = 0; variant < 6; ++variant) {
          RoutingConfig cfg;
          cfg.topk = k;
          cfg.score_function = variant >= 3 ? ScoreFunction::kSigmoid : ScoreFunction::kSoftmax;
          cfg.pre_softmax = variant == 1 || variant == 2;
          if (variant == 2) cfg.normalize = true;
          if (variant == 4) cfg.normalize = false;
          if (variant == 2 || variant == 5) cfg.scaling_factor = 2.5;
          const bool with_bias = variant == 5;
          const int64_t T = 67;
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " E=" << E << " k=" << k << " variant=" << variant);
          Buffer logits(dtype, {T, E});
          fill_normal(logits, rng, 0.0, 2.0);
          Buffer bias(DType::kFloat32, {E});
          fill_normal(bias, rng, 0.0, 0.3);
          const Routed r = run_route(logits, cfg, with_bias ? &bias.view() : nullptr);
          const std::vector<double> bias_d = with_bias ? to_doubles(bias) : std::vector<double>{};
          std::vector<int64_t> counts(static_cast<size_t>(E), 0);
          for (int64_t t = 0; t < T; ++t) {
            std::vector<double> x(static_cast<size_t>(E));
            for (int64_t e = 0; e < E; ++e) x[static_cast<size_t>(e)] = load_as_double(logits.data(), dtype, t * E + e);
            std::vector<int64_t> chosen;
            std::vector<double> p;
            const bool decidable = oracle_token(x, cfg, bias_d, &chosen, &p);
            int64_t on = 0;
            for (int64_t e = 0; e < E; ++e) {
              on += r.map.data_as<uint8_t>()[t * E + e];
              counts[static_cast<size_t>(e)] += r.map.data_as<uint8_t>()[t * E + e];
            }
            ASSERT_EQ(on, k) << "token " << t;
            if (!decidable) continue;
            ++compared;
            // fp32 scoring: exp/sigmoid within a few ulp, sums over at most E terms, a division
            // and a scaling: relative error well within (E + 16) * 4 * u32.
            const double rel = (E + 16) * 4 * u32;
            for (int64_t j = 0; j < k; ++j) {
              const int64_t e = chosen[static_cast<size_t>(j)];
              ASSERT_TRUE(r.map.data_as<uint8_t>()[t * E + e]) << "token " << t << " expert " << e;
              EXPECT_NEAR(r.probs.data_as<float>()[t * E + e], p[static_cast<size_t>(j)], rel * std::abs(p[static_cast<size_t>(j)]) + 1e-30)
                  << "token " << t << " expert " << e;
            }
            for (int64_t e = 0; e < E; ++e)
              if (!r.map.data_as<uint8_t>()[t * E + e]) {
                ASSERT_EQ(r.probs.data_as<float>()[t * E + e], 0.0f);
              }
          }
          for (int64_t e = 0; e < E; ++e) EXPECT_EQ(r.tokens_per_expert.data_as<int64_t>()[e], counts[static_cast<size_t>(e)]);
        }
      }
  EXPECT_GT(compared, 1000);  // near-ties are rare: almost every token is compared
}

// Capacity dropping from its definition, applied to the routing without capacity.
void oracle_capacity(const Tensor& map0, const Tensor& probs0, int64_t capacity, DropPolicy policy, bool pad,
                     std::vector<uint8_t>* map, std::vector<float>* probs) {
  const int64_t T = map0.shape[0], E = map0.shape[1];
  const uint8_t* m = map0.data_as<const uint8_t>();
  const float* p = probs0.data_as<const float>();
  map->assign(static_cast<size_t>(T * E), 0);
  probs->assign(static_cast<size_t>(T * E), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> order(static_cast<size_t>(T));
    std::iota(order.begin(), order.end(), int64_t{0});
    // Routed first (all of them when capacity >= T); "probs": by prob descending first.
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      if (policy == DropPolicy::kProbs && p[a * E + e] != p[b * E + e]) return p[a * E + e] > p[b * E + e];
      return m[a * E + e] > m[b * E + e];
    });
    const int64_t keep = std::min(capacity, T);
    for (int64_t j = 0; j < keep; ++j) {
      const int64_t t = order[static_cast<size_t>(j)];
      const bool on = pad || m[t * E + e];
      (*map)[static_cast<size_t>(t * E + e)] = on;
      if (on && m[t * E + e]) (*probs)[static_cast<size_t>(t * E + e)] = p[t * E + e];
    }
  }
}

TEST(MoeRouting, CapacityDroppingAndPadding) {
  std::mt19937_64 rng(test_seed());
  for (int64_t E : {1, 7, 16, 128})
    for (int64_t k : {1, 2, 5, 8}) {
      if (k > E) continue;
      for (double cf : {0.25, 1.0, 1.5, 1000.0})
        for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition})
          for (bool pad : {false, true}) {
            const int64_t T = 90;
            SCOPED_TRACE(::testing::Message() << "E=" << E << " k=" << k << " cf=" << cf << " pad=" << pad
                                              << " policy=" << static_cast<int>(policy));
            // bf16 logits: many exact ties in the probs, exercising the tie rules.
            Buffer logits(DType::kBFloat16, {T, E});
            fill_normal(logits, rng);
            RoutingConfig cfg;
            cfg.topk = k;
            const Routed r0 = run_route(logits, cfg);
            cfg.capacity_factor = cf;
            cfg.drop_policy = policy;
            cfg.pad_to_capacity = pad;
            const Routed r = run_route(logits, cfg);
            const int64_t capacity = moe::expert_capacity(T, E, k, cf);
            std::vector<uint8_t> want_map;
            std::vector<float> want_probs;
            oracle_capacity(r0.map, r0.probs, capacity, policy, pad, &want_map, &want_probs);
            ASSERT_EQ(std::memcmp(r.map.data(), want_map.data(), want_map.size()), 0);
            ASSERT_EQ(std::memcmp(r.probs.data(), want_probs.data(), want_probs.size() * 4), 0);
            // tokens_per_expert counts before dropping.
            EXPECT_TRUE(bitwise_equal(r.tokens_per_expert, r0.tokens_per_expert));
            if (pad) {
              for (int64_t e = 0; e < E; ++e) {
                int64_t n = 0;
                for (int64_t t = 0; t < T; ++t) n += r.map.data_as<uint8_t>()[t * E + e];
                EXPECT_EQ(n, std::min(capacity, T));
              }
            }
          }
    }
}

TEST(MoeRouting, BadConfigIsRejected) {
  Buffer logits(DType::kFloat32, {4, 3});
  RoutingConfig cfg;
  cfg.topk = 4;
  Buffer map(DType::kBool, {4, 3}), probs(DType::kFloat32, {4, 3}), tpe(DType::kInt64, {3});
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs, tpe), "'topk'");
  cfg.topk = 0;
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs, tpe), "'topk'");
  cfg.topk = 2;
  cfg.capacity_factor = 0.0;
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs, tpe), "'capacity_factor'");
  cfg.capacity_factor = -1.0;
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs, tpe), "'capacity_factor'");
  cfg.capacity_factor.reset();
  cfg.pad_to_capacity = true;
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs, tpe), "'pad_to_capacity'");
  cfg.pad_to_capacity = false;
  Buffer bias(DType::kFloat32, {3});
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, &bias.view(), map, probs, tpe), "'expert_bias'");
  cfg.score_function = ScoreFunction::kSigmoid;
  Buffer bias_bad(DType::kFloat32, {4});
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, &bias_bad.view(), map, probs, tpe), "'expert_bias'");
  Buffer probs_bad(DType::kBFloat16, {4, 3});
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map, probs_bad, tpe), "'probs'");
  Buffer map_bad(DType::kBool, {3, 3});
  EXPECT_LEANSTEP_ERROR(moe::route(logits, cfg, nullptr, map_bad, probs, tpe), "'routing_map'");
  EXPECT_LEANSTEP_ERROR(moe::expert_capacity(4, 3, 2, std::nan("")), "'capacity_factor'");
  EXPECT_LEANSTEP_ERROR(moe::drop_policy_from_name("random"), "'name'");
  // T = 0 and NaN logits just work (NaN ranks first, as torch.topk).
  Buffer empty(DType::kFloat32, {0, 3}), map0(DType::kBool, {0, 3}), probs0(DType::kFloat32, {0, 3});
  cfg.capacity_factor = 1.0;
  moe::route(empty, cfg, nullptr, map0, probs0, tpe);
  EXPECT_EQ(tpe.data_as<int64_t>()[0], 0);
  cfg.capacity_factor.reset();
  logits.data_as<float>()[2] = std::nanf("");
  moe::route(logits, cfg, nullptr, map, probs, tpe);
  EXPECT_TRUE(map.data_as<uint8_t>()[2]);
}

// ---------------------------------------------------------------- pad_routing_map

void expect_padded(const Tensor& before, const Tensor& after, int64_t multiple) {
  const int64_t T = before.shape[0], E = before.shape[1];
  const uint8_t* a = before.data_as<const uint8_t>();
  const uint8_t* b = after.data_as<const uint8_t>();
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t t = 0; t < T; ++t) count += a[t * E + e];
    int64_t to_pad = (multiple - count % multiple) % multiple;
    for (int64_t t = 0; t < T; ++t) {
      bool want = a[t * E + e];
      if (!want && to_pad > 0) {
        want = true;
        --to_pad;
      }
      ASSERT_EQ(b[t * E + e] != 0, want) << "token " << t << " expert " << e;
    }
  }
}

TEST(MoePadding, IssueGridAlign16) {
  std::mt19937_64 rng(test_seed());
  struct Case { int64_t T, E, H, k; };
  // The issue's padding grid. The permute after padding uses H capped at 256 for the two
  // large shapes (the order logic does not depend on H; full-width rows are covered by the
  // first case and by MoePermute.LargeShapeOnce) to keep the suite quick under ASan.
  for (const Case c : {Case{4096, 8, 1280, 2}, Case{4096, 64, 4096, 6}, Case{4096, 256, 7168, 6}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " H=" << c.H << " k=" << c.k);
    Buffer logits(DType::kFloat32, {c.T, c.E});
    fill_normal(logits, rng);
    RoutingConfig cfg;
    cfg.topk = c.k;
    const Routed r = run_route(logits, cfg);
    Buffer before(DType::kBool, {c.T, c.E});
    std::memcpy(before.data(), r.map.data(), before.nbytes());
    Buffer padded(DType::kBool, {c.T, c.E});
    moe::pad_routing_map(r.map, 16, padded);
    EXPECT_TRUE(bitwise_equal(before, r.map));  // the caller's map is not mutated
    expect_padded(before, padded, 16);
    // In place (out == map) gives the same map.
    moe::pad_routing_map(r.map, 16, r.map);
    EXPECT_TRUE(bitwise_equal(padded, r.map));

    const int64_t H = c.E == 8 ? c.H : 256;
    Buffer tokens(DType::kBFloat16, {c.T, H});
    fill_normal(tokens, rng);
    const int64_t N = moe::count_routed(padded);
    Buffer out_sort(DType::kBFloat16, {N, H}), out_fused(DType::kBFloat16, {N, H});
    Buffer idx_sort(DType::kInt64, {N}), idx_fused(DType::kInt64, {N});
    Buffer pp_sort(DType::kFloat32, {N}), pp_fused(DType::kFloat32, {N});
    moe::permute(tokens, padded, &r.probs.view(), N, false, Method::kSort, out_sort, &pp_sort.view(), idx_sort);
    moe::permute(tokens, padded, &r.probs.view(), N, false, Method::kFused, out_fused, &pp_fused.view(), idx_fused);
    EXPECT_TRUE(bitwise_equal(out_sort, out_fused));
    EXPECT_TRUE(bitwise_equal(idx_sort, idx_fused));
    EXPECT_TRUE(bitwise_equal(pp_sort, pp_fused));
    ASSERT_EQ(index_values(idx_fused), oracle_slots(padded, N, false).token);
    // Every expert's segment is a multiple of 16 (each has >= 4096 - 6 * 4096 / E unrouted tokens,
    // enough to pad); padded slots carry prob 0.
    for (int64_t e = 0; e < c.E; ++e) {
      int64_t n = 0;
      for (int64_t t = 0; t < c.T; ++t) n += padded.data_as<uint8_t>()[t * c.E + e];
      EXPECT_EQ(n % 16, 0) << "expert " << e;
    }
    int64_t zero_probs = 0;
    for (int64_t i = 0; i < N; ++i) zero_probs += pp_fused.data_as<float>()[i] == 0.0f;
    EXPECT_EQ(zero_probs, N - moe::count_routed(before));
  }
}

TEST(MoePadding, ShortExpertsAndBadInput) {
  // 4 routed of 5 tokens, multiple 8: only one unrouted token can be switched on.
  Buffer map(DType::kBool, {5, 2}), out(DType::kBool, {5, 2});
  for (int64_t t = 0; t < 4; ++t) map.data_as<uint8_t>()[t * 2] = 1;
  moe::pad_routing_map(map, 8, out);
  expect_padded(map, out, 8);
  EXPECT_EQ(moe::count_routed(out), 5);  // expert 0: 4 + 1 (stays short of 8); expert 1: 0 stays 0
  moe::pad_routing_map(map, 1, out);
  EXPECT_TRUE(bitwise_equal(map, out));
  Buffer empty(DType::kBool, {0, 3}), empty_out(DType::kBool, {0, 3});
  moe::pad_routing_map(empty, 16, empty_out);
  EXPECT_LEANSTEP_ERROR(moe::pad_routing_map(map, 0, out), "'multiple'");
  Buffer out_bad(DType::kBool, {5, 3});
  EXPECT_LEANSTEP_ERROR(moe::pad_routing_map(map, 4, out_bad), "'out'");
  Tensor partial(static_cast<uint8_t*>(map.data()) + 2, DType::kBool, {4, 2});
  Tensor map4(map.data(), DType::kBool, {4, 2});
  EXPECT_LEANSTEP_ERROR(moe::pad_routing_map(map4, 4, partial), "overlap");
}

// ---------------------------------------------------------------- sort_chunks_by_idxs

TEST(MoeChunks, SortChunksMatchesConcatenation) {
  std::mt19937_64 rng(test_seed());
  const int64_t local_experts = 4;
  for (DType dtype : float_dtypes())
    for (int64_t tp : {1, 2, 8})
      for (bool random_order : {false, true})
        for (int64_t tail : {0, 5}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " tp=" << tp << " random=" << random_order << " tail=" << tail);
          const int64_t C = tp * local_experts;
          std::uniform_int_distribution<int64_t> size(0, 40);
          std::vector<int64_t> sizes(static_cast<size_t>(C));
          for (auto& s : sizes) s = size(rng);
          sizes[0] = 0;  // an empty chunk
          std::vector<int64_t> order;
          if (random_order) {
            order.resize(static_cast<size_t>(C));
            std::iota(order.begin(), order.end(), int64_t{0});
            std::shuffle(order.begin(), order.end(), rng);
          } else {
            // Megatron's regrouping after the all-to-all: [tp, local] chunks -> [local, tp].
            for (int64_t l = 0; l < local_experts; ++l)
              for (int64_t r = 0; r < tp; ++r) order.push_back(r * local_experts + l);
          }
          const int64_t R = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) + tail;
          const int64_t H = 3;
          Buffer rows(dtype, {R, H}), out(dtype, {R, H}), probs(DType::kFloat32, {R}), out_probs(DType::kFloat32, {R});
          fill_normal(rows, rng);
          fill_normal(probs, rng);
          for (DType idx_dtype : {DType::kInt64, DType::kInt32}) {
            Buffer split = index_buffer(sizes, idx_dtype), sorted = index_buffer(order, idx_dtype);
            moe::sort_chunks_by_idxs(rows, split, sorted, out, &probs.view(), &out_probs.view());
            std::vector<int64_t> start(static_cast<size_t>(C) + 1, 0);
            for (int64_t c = 0; c < C; ++c) start[static_cast<size_t>(c + 1)] = start[static_cast<size_t>(c)] + sizes[static_cast<size_t>(c)];
            std::vector<int64_t> want_rows;
            for (int64_t c : order)
              for (int64_t r = start[static_cast<size_t>(c)]; r < start[static_cast<size_t>(c + 1)]; ++r) want_rows.push_back(r);
            for (int64_t r = start[static_cast<size_t>(C)]; r < R; ++r) want_rows.push_back(r);
            const size_t rb = static_cast<size_t>(H) * rows.view().element_size();
            for (int64_t i = 0; i < R; ++i) {
              ASSERT_EQ(std::memcmp(static_cast<const char*>(out.data()) + static_cast<size_t>(i) * rb,
                                    static_cast<const char*>(rows.data()) + static_cast<size_t>(want_rows[static_cast<size_t>(i)]) * rb, rb),
                        0)
                  << "row " << i;
              ASSERT_EQ(out_probs.data_as<float>()[i], probs.data_as<float>()[want_rows[static_cast<size_t>(i)]]);
            }
          }
        }
}

TEST(MoeChunks, BadInputIsRejected) {
  Buffer rows(DType::kFloat32, {10, 2}), out(DType::kFloat32, {10, 2});
  Buffer sizes = index_buffer({3, 4, 3});
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({0, 0, 1}), out), "permutation");
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({0, 3, 1}), out), "permutation");
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({0, 1}), out), "'sorted_idxs'");
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, index_buffer({3, 4, 4}), index_buffer({2, 1, 0}), out), "sum to at most");
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, index_buffer({3, -1, 4}), index_buffer({2, 1, 0}), out), ">= 0");
  Buffer out_bad(DType::kBFloat16, {10, 2});
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({2, 1, 0}), out_bad), "'out'");
  Buffer probs(DType::kFloat32, {10});
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({2, 1, 0}), out, &probs.view(), nullptr), "'out_probs'");
  EXPECT_LEANSTEP_ERROR(moe::sort_chunks_by_idxs(rows, sizes, index_buffer({2, 1, 0}), rows), "overlap");
  // No chunks at all: every row keeps its place.
  Buffer none(DType::kInt64, {0});
  moe::sort_chunks_by_idxs(rows, none, none, out);
}

}  // namespace
}  // namespace leanstep::testing
