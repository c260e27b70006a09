// Top-k routing with softmax/sigmoid scoring and optional capacity dropping
// (Megatron-Core's topk_routing_with_score_function + apply_router_token_dropping
// semantics, computed in fp32, with every tie broken deterministically).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/parallel.h"
#include "leanstep/moe.h"
#include "moe/common.h"

namespace leanstep::moe {

namespace {

constexpr const char* kWhere = "route";
constexpr int64_t kTokenChunk = 64;

// Ranking of scores: NaN above every number (torch.topk's order), then larger first.
inline bool ranks_above(float a, float b) {
  if (std::isnan(a)) return !std::isnan(b);
  if (std::isnan(b)) return false;
  return a > b;
}

// Indices of the k best scores, best first; ties go to the lower index.
void top_k(const float* scores, int64_t E, int64_t k, int64_t* out, std::vector<int64_t>& order) {
  order.resize(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), int64_t{0});
  auto better = [&](int64_t a, int64_t b) {
    if (ranks_above(scores[a], scores[b])) return true;
    if (ranks_above(scores[b], scores[a])) return false;
    return a < b;
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  std::copy(order.begin(), order.begin() + k, out);
}

}  // namespace

ScoreFunction score_function_from_name(std::string_view name) {
  if (name == "softmax") return ScoreFunction::kSoftmax;
  if (name == "sigmoid") return ScoreFunction::kSigmoid;
  throw_arg_error("score_function_from_name", "name",
                  fmt::format("must be \"softmax\" or \"sigmoid\" (got \"{}\")", name));
}

DropPolicy drop_policy_from_name(std::string_view name) {
  if (name == "probs") return DropPolicy::kProbs;
  if (name == "position") return DropPolicy::kPosition;
  throw_arg_error("drop_policy_from_name", "name",
                  fmt::format("must be \"probs\" or \"position\" (got \"{}\")", name));
}

int64_t expert_capacity(int64_t num_tokens, int64_t num_experts, int64_t topk, double capacity_factor) {
  LEANSTEP_CHECK_ARG(num_tokens >= 0, "expert_capacity", "num_tokens", fmt::format("must be >= 0 (got {})", num_tokens));
  LEANSTEP_CHECK_ARG(num_experts >= 1, "expert_capacity", "num_experts", fmt::format("must be >= 1 (got {})", num_experts));
  LEANSTEP_CHECK_ARG(topk >= 1 && topk <= num_experts, "expert_capacity", "topk",
                     fmt::format("must be in [1, E={}] (got {})", num_experts, topk));
  LEANSTEP_CHECK_ARG(std::isfinite(capacity_factor) && capacity_factor > 0, "expert_capacity", "capacity_factor",
                     fmt::format("must be finite and > 0 (got {})", capacity_factor));
  const double capacity =
      std::ceil(static_cast<double>(num_tokens) * static_cast<double>(topk) / static_cast<double>(num_experts) *
                capacity_factor);
  LEANSTEP_CHECK_ARG(capacity < 9.0e18, "expert_capacity", "capacity_factor",
                     fmt::format("gives a capacity beyond int64 (got {})", capacity_factor));
  return static_cast<int64_t>(capacity);
}

void route(const Tensor& logits, const RoutingConfig& config, const Tensor* expert_bias,
           const Tensor& routing_map, const Tensor& probs, const Tensor& tokens_per_expert) {
  check_tensor(logits, kWhere, "logits");
  check_cpu(logits, kWhere, "logits");
  check_dtype(logits, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, kWhere, "logits");
  LEANSTEP_CHECK_ARG(logits.ndim == 2 && logits.is_contiguous(), kWhere, "logits",
                     fmt::format("must be a contiguous [T, E] tensor (got {})", logits.describe()));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  const int64_t k = config.topk;
  LEANSTEP_CHECK_ARG(E >= 1, kWhere, "logits", "must have at least one expert column");
  LEANSTEP_CHECK_ARG(k >= 1 && k <= E, kWhere, "topk", fmt::format("must be in [1, E={}] (got {})", E, k));
  if (config.capacity_factor)
    LEANSTEP_CHECK_ARG(std::isfinite(*config.capacity_factor) && *config.capacity_factor > 0, kWhere,
                       "capacity_factor", fmt::format("must be finite and > 0 (got {})", *config.capacity_factor));
  LEANSTEP_CHECK_ARG(!config.pad_to_capacity || config.capacity_factor, kWhere, "pad_to_capacity",
                     "requires a capacity_factor");
  if (config.scaling_factor)
    LEANSTEP_CHECK_ARG(std::isfinite(*config.scaling_factor), kWhere, "scaling_factor",
                       fmt::format("must be finite (got {})", *config.scaling_factor));
  LEANSTEP_CHECK_ARG(!(config.pre_softmax && config.score_function == ScoreFunction::kSigmoid), kWhere,
                     "pre_softmax", "applies to softmax scoring only");
  const float* bias = nullptr;
  if (expert_bias) {
    check_tensor(*expert_bias, kWhere, "expert_bias");
    check_cpu(*expert_bias, kWhere, "expert_bias");
    check_dtype(*expert_bias, {DType::kFloat32}, kWhere, "expert_bias");
    LEANSTEP_CHECK_ARG(config.score_function == ScoreFunction::kSigmoid, kWhere, "expert_bias",
                       "is supported with sigmoid scoring only");
    LEANSTEP_CHECK_ARG(expert_bias->ndim == 1 && expert_bias->shape[0] == E && expert_bias->is_contiguous(), kWhere,
                       "expert_bias", fmt::format("must be contiguous [E={}] (got {})", E, expert_bias->describe()));
    bias = expert_bias->data_as<const float>();
  }
  auto check_out = [&](const Tensor& t, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
    check_tensor(t, kWhere, name);
    check_cpu(t, kWhere, name);
    check_dtype(t, {dtype}, kWhere, name);
    bool ok = t.ndim == static_cast<int>(shape.size()) && t.is_contiguous();
    int d = 0;
    for (int64_t s : shape) ok = ok && t.shape[d++] == s;
    LEANSTEP_CHECK_ARG(ok, kWhere, name,
                       fmt::format("must be contiguous with shape [{}] (got {})", fmt::join(shape, ", "), t.describe()));
  };
  check_out(routing_map, "routing_map", DType::kBool, {T, E});
  check_out(probs, "probs", DType::kFloat32, {T, E});
  check_out(tokens_per_expert, "tokens_per_expert", DType::kInt64, {E});

  uint8_t* map = routing_map.data_as<uint8_t>();
  float* out_probs = probs.data_as<float>();
  const bool normalize =
      config.normalize.value_or(config.score_function == ScoreFunction::kSigmoid && k > 1);
  const float scale = config.scaling_factor ? static_cast<float>(*config.scaling_factor) : 1.0f;

  // Per token: scores, top-k, probs of the chosen experts.
  leanstep::detail::parallel_chunks(T, kTokenChunk, [&](int64_t, int64_t begin, int64_t end) {
    std::vector<float> x(static_cast<size_t>(E)), score(static_cast<size_t>(E));
    std::vector<int64_t> chosen(static_cast<size_t>(k)), order;
    std::vector<float> p(static_cast<size_t>(k));
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(static_cast<const char*>(logits.data) + static_cast<size_t>(t * E) * logits.element_size(),
                     logits.dtype, x.data(), E);
      if (config.score_function == ScoreFunction::kSoftmax) {
        if (config.pre_softmax) {
          float m = x[0];
          for (int64_t e = 1; e < E; ++e) m = std::max(m, x[static_cast<size_t>(e)]);
          float sum = 0.0f;
          for (int64_t e = 0; e < E; ++e) sum += (score[static_cast<size_t>(e)] = std::exp(x[static_cast<size_t>(e)] - m));
          for (int64_t e = 0; e < E; ++e) score[static_cast<size_t>(e)] /= sum;
          top_k(score.data(), E, k, chosen.data(), order);
          for (int64_t j = 0; j < k; ++j) p[static_cast<size_t>(j)] = score[static_cast<size_t>(chosen[static_cast<size_t>(j)])];
        } else {
          top_k(x.data(), E, k, chosen.data(), order);
          const float m = x[static_cast<size_t>(chosen[0])];  // the largest chosen logit
          float sum = 0.0f;
          for (int64_t j = 0; j < k; ++j)
            sum += (p[static_cast<size_t>(j)] = std::exp(x[static_cast<size_t>(chosen[static_cast<size_t>(j)])] - m));
          for (int64_t j = 0; j < k; ++j) p[static_cast<size_t>(j)] /= sum;
        }
      } else {
        for (int64_t e = 0; e < E; ++e) {
          const float s = 1.0f / (1.0f + std::exp(-x[static_cast<size_t>(e)]));
          x[static_cast<size_t>(e)] = s;  // unbiased sigmoid, the probs
          score[static_cast<size_t>(e)] = bias ? s + bias[e] : s;
        }
        top_k(score.data(), E, k, chosen.data(), order);
        for (int64_t j = 0; j < k; ++j) p[static_cast<size_t>(j)] = x[static_cast<size_t>(chosen[static_cast<size_t>(j)])];
      }
      if (normalize) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) sum += p[static_cast<size_t>(j)];
        for (int64_t j = 0; j < k; ++j) p[static_cast<size_t>(j)] /= (sum + 1e-20f);
      }
      uint8_t* map_row = map + t * E;
      float* prob_row = out_probs + t * E;
      std::fill(map_row, map_row + E, uint8_t{0});
      std::fill(prob_row, prob_row + E, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = chosen[static_cast<size_t>(j)];
        map_row[e] = 1;
        prob_row[e] = config.scaling_factor ? p[static_cast<size_t>(j)] * scale : p[static_cast<size_t>(j)];
      }
    }
  });

  int64_t* counts = tokens_per_expert.data_as<int64_t>();
  std::fill(counts, counts + E, int64_t{0});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) counts[e] += map[t * E + e];

  if (!config.capacity_factor) return;
  const int64_t capacity = expert_capacity(T, E, k, *config.capacity_factor);
  if (capacity >= T) {
    // Every token fits: nothing is dropped; padding routes every token (prob 0 where unrouted).
    if (config.pad_to_capacity) std::fill(map, map + T * E, uint8_t{1});
    return;
  }
  // Per expert: rank all T tokens, keep the first `capacity`.
  //   "probs":    prob descending, routed before unrouted, then token index;
  //   "position": routed before unrouted, then token index.
  leanstep::detail::parallel_items(E, [&](int64_t e) {
    std::vector<int64_t> order(static_cast<size_t>(T));
    std::iota(order.begin(), order.end(), int64_t{0});
    auto better = [&](int64_t a, int64_t b) {
      if (config.drop_policy == DropPolicy::kProbs) {
        const float pa = out_probs[a * E + e], pb = out_probs[b * E + e];
        if (ranks_above(pa, pb)) return true;
        if (ranks_above(pb, pa)) return false;
      }
      const uint8_t ra = map[a * E + e], rb = map[b * E + e];
      if (ra != rb) return ra > rb;
      return a < b;
    };
    std::partial_sort(order.begin(), order.begin() + capacity, order.end(), better);
    std::vector<uint8_t> keep(static_cast<size_t>(T), 0);
    for (int64_t j = 0; j < capacity; ++j) keep[static_cast<size_t>(order[static_cast<size_t>(j)])] = 1;
    for (int64_t t = 0; t < T; ++t) {
      uint8_t& m = map[t * E + e];
      const bool on = config.pad_to_capacity ? keep[static_cast<size_t>(t)] != 0 : (m && keep[static_cast<size_t>(t)]);
      if (!on || !m) out_probs[t * E + e] = 0.0f;  // dropped, or a padding slot (prob 0)
      m = on ? 1 : 0;
    }
  });
}

}  // namespace leanstep::moe
