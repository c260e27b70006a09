// The model's math: whole-model float64 finite-difference gradient check on a
// micro config, and the fp32 model against the float64 model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "leanstep/moe.h"
#include "leanstep/train.h"
#include "test_util.h"
#include "train/model.h"
#include "train_reference_kernels.h"

namespace {

using namespace leanstep;
using namespace leanstep::train;
using leanstep::testing::test_seed;

Config micro_config() {
  return load_config(std::string(LEANSTEP_SOURCE_DIR) + "/examples/tiny-moe/micro.json");
}

// Contiguous offsets in registration order (the trainer uses the DDP layout instead;
// the model only needs an offset per tensor).
std::vector<int64_t> packed_offsets(const std::vector<TensorInfo>& tensors, int64_t* total) {
  std::vector<int64_t> off;
  int64_t o = 0;
  for (const auto& t : tensors) {
    off.push_back(o);
    o += t.numel();
  }
  *total = o;
  return off;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t batch, int64_t seq, int64_t vocab) {
  std::vector<int32_t> tok(static_cast<size_t>(batch * (seq + 1)));
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  for (auto& t : tok) t = dist(rng);
  return tok;
}

struct MicroModel {
  Config cfg;
  std::vector<TensorInfo> tensors;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  std::vector<float> params32;
  detail::BaseWeights<double> base64;
  detail::BaseWeights<float> base32;

  explicit MicroModel(const Config& c, uint64_t seed) : cfg(c) {
    tensors = adapter_tensors(cfg.model, cfg.lora);
    offsets = packed_offsets(tensors, &total);
    params32.assign(static_cast<size_t>(total), 0.0f);
    // Non-zero B so every adapter tensor gets a non-zero gradient.
    detail::init_adapters(tensors, offsets, seed, params32.data(), 0.3);
    base64 = detail::make_base_weights<double>(cfg.model, seed);
    base32 = detail::make_base_weights<float>(cfg.model, seed);
  }
};

TEST(TrainModel, AdapterTensorsFollowTargets) {
  Config c = micro_config();
  const auto all = adapter_tensors(c.model, c.lora);
  // per layer: qkv A,B + proj A,B + fc1 2E + fc2 2E
  const int64_t e = c.model.num_experts;
  EXPECT_EQ(static_cast<int64_t>(all.size()), c.model.num_hidden_layers * (4 + 4 * e));
  EXPECT_EQ(all[0].name, "decoder.layers.0.self_attention.linear_qkv.lora_A.weight");
  EXPECT_EQ(all[0].shape, (std::vector<int64_t>{2, 16}));
  // qkv out = (4 + 2*2) * 4 = 32
  EXPECT_EQ(all[1].shape, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(all[4].name, "decoder.layers.0.mlp.experts.linear_fc1.lora_A.weight0");
  c.lora.targets = {"linear_fc2"};
  const auto fc2 = adapter_tensors(c.model, c.lora);
  ASSERT_EQ(static_cast<int64_t>(fc2.size()), c.model.num_hidden_layers * 2 * e);
  EXPECT_EQ(fc2[0].shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(fc2[static_cast<size_t>(e)].shape, (std::vector<int64_t>{16, 2}));
}

// Whole-model gradient check in float64: the analytic adapter gradients of the
// mean cross-entropy against central differences. With h = 1e-6 the truncation
// error is O(h^2 |f'''|) ~ 1e-12 and the rounding error ~ eps * |f| / h ~ 1e-10,
// so 1e-7 absolute + 1e-5 relative leaves a wide margin while any wrong term
// (a missing LoRA scale, a transposed rotation, a dropped router path) is off
// by O(|g|) >> 1e-5 |g|. A perturbation that flips a top-k choice would make
// the loss non-smooth; with random logits that has probability ~1e-5 per probe.
TEST(TrainModel, GradientCheckFloat64) {
  const uint64_t seed = test_seed();
  for (bool norm_topk : {true, false}) {
    Config cfg = micro_config();
    cfg.model.norm_topk_prob = norm_topk;
    MicroModel mm(cfg, seed);
    std::vector<double> p(mm.params32.begin(), mm.params32.end());
    std::vector<double> g(p.size(), 0.0);
    detail::Model<double> model(cfg.model, cfg.lora, &mm.base64, detail::make_slots(cfg.model, mm.tensors, mm.offsets),
                                detail::reference_kernels<double>());
    std::mt19937_64 rng(seed);
    const int64_t batch = cfg.train.micro_batch_size, seq = cfg.train.seq_len;
    const auto tokens = random_tokens(rng, batch, seq, cfg.model.vocab_size);
    const double loss = model.forward_backward(tokens.data(), batch, seq, p.data(), g.data(), 1.0);
    ASSERT_TRUE(std::isfinite(loss));
    // Probe 3 random elements of every tensor.
    int checked = 0, nonzero_expert_tensors = 0;
    double worst = 0.0;
    for (size_t ti = 0; ti < mm.tensors.size(); ++ti) {
      const int64_t n = mm.tensors[ti].numel();
      double tensor_abs = 0.0;
      for (int64_t i = 0; i < n; ++i) tensor_abs += std::abs(g[static_cast<size_t>(mm.offsets[ti] + i)]);
      // An expert that received no token has a zero gradient (legitimately: with
      // 12 tokens x top-2 of 4 experts that happens); every other tensor must not.
      if (mm.tensors[ti].name.find("mlp.experts") != std::string::npos) nonzero_expert_tensors += tensor_abs > 0;
      else EXPECT_GT(tensor_abs, 0.0) << mm.tensors[ti].name << " has an all-zero gradient";
      for (int probe = 0; probe < 3; ++probe) {
        const size_t idx = static_cast<size_t>(mm.offsets[ti] + static_cast<int64_t>(rng() % static_cast<uint64_t>(n)));
        const double h = 1e-6, saved = p[idx];
        p[idx] = saved + h;
        const double lp = model.forward_backward(tokens.data(), batch, seq, p.data(), nullptr, 1.0);
        p[idx] = saved - h;
        const double lm = model.forward_backward(tokens.data(), batch, seq, p.data(), nullptr, 1.0);
        p[idx] = saved;
        const double fd = (lp - lm) / (2 * h);
        const double err = std::abs(fd - g[idx]);
        worst = std::max(worst, err / (1e-7 + 1e-5 * std::abs(g[idx])));
        EXPECT_LE(err, 1e-7 + 1e-5 * std::abs(g[idx]))
            << mm.tensors[ti].name << " element " << idx - static_cast<size_t>(mm.offsets[ti]) << ": analytic "
            << g[idx] << " vs finite difference " << fd << " (norm_topk_prob=" << norm_topk << ")";
        ++checked;
      }
    }
    EXPECT_GT(checked, 60);
    EXPECT_GE(nonzero_expert_tensors, 2 * 4) << "at least one expert per layer and fc gets tokens";
    std::printf("[ info     ] norm_topk_prob=%d: %d probes, worst error / tolerance %.3g\n", norm_topk, checked, worst);
  }
}

// The dloss_scale argument scales the accumulated gradients and they accumulate (+=).
TEST(TrainModel, GradientsAccumulateAndScale) {
  const uint64_t seed = test_seed();
  Config cfg = micro_config();
  MicroModel mm(cfg, seed);
  std::vector<double> p(mm.params32.begin(), mm.params32.end());
  detail::Model<double> model(cfg.model, cfg.lora, &mm.base64, detail::make_slots(cfg.model, mm.tensors, mm.offsets),
                              detail::reference_kernels<double>());
  std::mt19937_64 rng(seed);
  const auto tokens = random_tokens(rng, 2, 6, cfg.model.vocab_size);
  std::vector<double> g1(p.size(), 0.0), g2(p.size(), 0.0);
  model.forward_backward(tokens.data(), 2, 6, p.data(), g1.data(), 1.0);
  model.forward_backward(tokens.data(), 2, 6, p.data(), g2.data(), 0.25);
  model.forward_backward(tokens.data(), 2, 6, p.data(), g2.data(), 0.5);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(g2[i], 0.75 * g1[i], 1e-12 + 1e-12 * std::abs(g1[i]));
}

// The fp32 model against the float64 model with the same weights: loss and
// gradients agree to fp32 accuracy. Errors grow with depth and with the
// O(100)-term dot products; 2e-5 on the loss (~5.5) bounds a few hundred ulps of
// accumulated fp32 rounding; the gradients' bound is stated below in ulps.
TEST(TrainModel, Float32MatchesFloat64) {
  const uint64_t seed = test_seed();
  Config cfg = micro_config();
  MicroModel mm(cfg, seed);
  std::vector<double> p64(mm.params32.begin(), mm.params32.end()), g64(p64.size(), 0.0);
  std::vector<float> g32(p64.size(), 0.0f);
  const auto slots = detail::make_slots(cfg.model, mm.tensors, mm.offsets);
  detail::Model<double> m64(cfg.model, cfg.lora, &mm.base64, slots, detail::reference_kernels<double>());
  detail::Model<float> m32(cfg.model, cfg.lora, &mm.base32, slots, detail::reference_kernels<float>());
  std::mt19937_64 rng(seed);
  const auto tokens = random_tokens(rng, 3, 9, cfg.model.vocab_size);
  const double l64 = m64.forward_backward(tokens.data(), 3, 9, p64.data(), g64.data(), 1.0);
  const double l32 = m32.forward_backward(tokens.data(), 3, 9, mm.params32.data(), g32.data(), 1.0);
  EXPECT_NEAR(l32, l64, 2e-5 * std::abs(l64));
  double gmax = 0.0;
  for (double v : g64) gmax = std::max(gmax, std::abs(v));
  ASSERT_GT(gmax, 0.0);
  // Per element, in fp32 ulps: |g32 - g64| <= 256 ulp(g64) + 2^-13 gmax, where ulp(v) =
  // 2 u32 |v| = 2^-23 |v| (so 256 ulps = 3.05e-5 relative). The relative part bounds the
  // accumulated rounding of a gradient of typical size (depth x dot products of ~100
  // terms: a few hundred ulps at most); the absolute part, 2^-13 = 1.2e-4 of the largest
  // gradient (16 times tighter than the former 2e-3 gmax), covers elements that are
  // small because of cancellation, whose absolute error is set by the magnitudes that
  // cancelled. A wrong term is off by O(|g|), thousands of times either part.
  const double ulp32 = std::ldexp(1.0, -23);
  double worst_ratio = 0.0;
  for (size_t i = 0; i < g64.size(); ++i) {
    const double bound = 256 * ulp32 * std::abs(g64[i]) + std::ldexp(gmax, -13);
    const double err = std::abs(static_cast<double>(g32[i]) - g64[i]);
    worst_ratio = std::max(worst_ratio, err / bound);
    EXPECT_LE(err, bound) << "element " << i << ": fp32 " << g32[i] << ", fp64 " << g64[i] << " ("
                          << err / (ulp32 * std::abs(g64[i])) << " ulps of fp64's value)";
  }
  RecordProperty("worst_error_over_bound", std::to_string(worst_ratio));
  std::printf("[ bound    ] worst |g32 - g64| / bound = %.3g\n", worst_ratio);
}

TEST(TrainModel, RejectsOutOfVocabularyTokens) {
  const uint64_t seed = test_seed();
  Config cfg = micro_config();
  MicroModel mm(cfg, seed);
  detail::Model<float> m32(cfg.model, cfg.lora, &mm.base32, detail::make_slots(cfg.model, mm.tensors, mm.offsets),
                           detail::reference_kernels<float>());
  std::vector<int32_t> tokens(7, 1);
  tokens[3] = 256;
  EXPECT_LEANSTEP_ERROR(m32.forward_backward(tokens.data(), 1, 6, mm.params32.data(), nullptr, 1.0), "tokens");
}

}  // namespace

namespace leanstep::train {
namespace {

// The fp32 trainer routes with moe::route (softmax over every expert, top k,
// optional renormalisation: pre_softmax, normalize); the model's reference
// router is the oracle: the same experts, probabilities within a few fp32 ulps.
TEST(TrainModel, LibraryRouterMatchesTheReferenceRouter) {
  std::mt19937_64 rng(leanstep::testing::test_seed());
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t n = 57, e = 12, k = 3;
  std::vector<float> logits(static_cast<size_t>(n * e));
  for (float& v : logits) v = normal(rng);
  for (bool normalize : {false, true}) {
    std::vector<uint8_t> map_ref(static_cast<size_t>(n * e), 0), map_lib(static_cast<size_t>(n * e), 0);
    std::vector<float> probs_ref(static_cast<size_t>(n * e), 0.0f), probs_lib(static_cast<size_t>(n * e), 0.0f);
    detail::reference_kernels<float>().route(logits.data(), n, e, k, normalize, map_ref.data(), probs_ref.data());
    moe::RoutingConfig rc;
    rc.topk = k;
    rc.pre_softmax = true;
    rc.normalize = normalize;
    std::vector<int64_t> per_expert(static_cast<size_t>(e));
    moe::route(Tensor(logits.data(), DType::kFloat32, {n, e}), rc, nullptr, Tensor(map_lib.data(), DType::kBool, {n, e}),
               Tensor(probs_lib.data(), DType::kFloat32, {n, e}), Tensor(per_expert.data(), DType::kInt64, {e}));
    EXPECT_EQ(map_ref, map_lib) << "normalize " << normalize;
    for (size_t i = 0; i < probs_ref.size(); ++i)
      EXPECT_NEAR(probs_lib[i], probs_ref[i], 8 * 1.2e-7 * std::fabs(probs_ref[i])) << i;
  }
}

}  // namespace
}  // namespace leanstep::train
