// MoE test helpers: random routing maps with the awkward cases built in, and
// straightforward oracles written from the semantics (docs/moe.md), independent
// of the library's code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/moe.h"
#include "test_util.h"

namespace leanstep::testing {

// A bool [T, E] map: every token picks k distinct random experts, except that about
// `nowhere_fraction` of tokens are routed nowhere; expert `empty_expert` (if >= 0) gets none.
inline Buffer random_map(int64_t T, int64_t E, int64_t k, std::mt19937_64& rng, double nowhere_fraction = 0.1,
                         int64_t empty_expert = -1) {
  Buffer map(DType::kBool, {T, E});
  uint8_t* m = map.data_as<uint8_t>();
  std::vector<int64_t> experts(static_cast<size_t>(E));
  std::iota(experts.begin(), experts.end(), int64_t{0});
  std::bernoulli_distribution nowhere(nowhere_fraction);
  for (int64_t t = 0; t < T; ++t) {
    if (nowhere(rng)) continue;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t j = 0; j < k; ++j) m[t * E + experts[static_cast<size_t>(j)]] = 1;
  }
  if (empty_expert >= 0)
    for (int64_t t = 0; t < T; ++t) m[t * E + empty_expert] = 0;
  return map;
}

struct Slots {
  std::vector<int64_t> token;   // -1: no source
  std::vector<int64_t> expert;  // -1: none
};

// The permutation order from its definition: experts in order; per expert its routed tokens
// in token order (drop_and_pad: then its unrouted tokens, first `capacity` kept).
inline Slots oracle_slots(const Tensor& map, int64_t num_out, bool drop_and_pad) {
  const int64_t T = map.shape[0], E = map.shape[1];
  const uint8_t* m = map.data_as<const uint8_t>();
  Slots s;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> list;
    for (int64_t t = 0; t < T; ++t)
      if (m[t * E + e]) list.push_back(t);
    if (drop_and_pad) {
      for (int64_t t = 0; t < T; ++t)
        if (!m[t * E + e]) list.push_back(t);
      list.resize(static_cast<size_t>(num_out / E));
    }
    for (int64_t t : list) {
      s.token.push_back(t);
      s.expert.push_back(e);
    }
  }
  while (static_cast<int64_t>(s.token.size()) < num_out) {
    s.token.push_back(-1);
    s.expert.push_back(-1);
  }
  return s;
}

inline Buffer index_buffer(const std::vector<int64_t>& v, DType dtype = DType::kInt64) {
  Buffer b(dtype, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kInt64) b.data_as<int64_t>()[i] = v[i];
    else b.data_as<int32_t>()[i] = static_cast<int32_t>(v[i]);
  }
  return b;
}

// A routing that sends every token to k of E experts, its N slots in the oracle's
// order and their tokens as an index tensor: the set-up of the unpermute tests
// that place values at chosen slots.
struct EveryTokenRouted {
  EveryTokenRouted(int64_t T, int64_t E, int64_t k, std::mt19937_64& rng)
      : map(random_map(T, E, k, rng, 0.0)),
        N(moe::count_routed(map)),
        slots(oracle_slots(map, N, false)),
        indices(index_buffer(slots.token)) {}
  Buffer map;
  int64_t N;
  Slots slots;
  Buffer indices;
};

inline std::vector<int64_t> index_values(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[static_cast<size_t>(i)] = t.dtype == DType::kInt64 ? t.data_as<int64_t>()[i] : t.data_as<int32_t>()[i];
  return v;
}

// Random probs [T, E]: positive where routed, 0 elsewhere (as the router writes them).
inline Buffer random_probs(const Tensor& map, DType dtype, std::mt19937_64& rng) {
  const int64_t T = map.shape[0], E = map.shape[1];
  Buffer probs(dtype, {T, E});
  std::uniform_real_distribution<double> u(0.05, 1.0);
  for (int64_t j = 0; j < T * E; ++j)
    store_from_double(probs.data(), dtype, j, map.data_as<const uint8_t>()[j] ? u(rng) : 0.0);
  return probs;
}

}  // namespace leanstep::testing
