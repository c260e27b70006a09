// Google Benchmark programs for MoE kernel work (the user-facing comparison is
// `leanstep bench moe`). Shapes: T=4096, E=128, k=8, H=2048 (Qwen3-Omni-like), and
// the main job's T=128, E=8, k=2, H=256, where per-call costs show.
#include <benchmark/benchmark.h>

#include <random>

#include "leanstep/buffer.h"
#include "leanstep/moe.h"

namespace {

using namespace leanstep;

struct Setup {
  int64_t T, E, k, H;
  Buffer map, probs, tpe;
  Buffer tokens, permuted, permuted_probs, indices, restored;
  int64_t N = 0;
  Setup(DType dtype, bool small)
      : T(small ? 128 : 4096), E(small ? 8 : 128), k(small ? 2 : 8), H(small ? 256 : 2048),
        map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E}), tpe(DType::kInt64, {E}) {
    Buffer logits(DType::kFloat32, {T, E});
    std::mt19937 rng(1);
    std::normal_distribution<float> d;
    for (int64_t i = 0; i < T * E; ++i) logits.data_as<float>()[i] = d(rng);
    moe::RoutingConfig cfg;
    cfg.topk = k;
    moe::route(logits, cfg, nullptr, map, probs, tpe);
    N = moe::count_routed(map);
    tokens = Buffer(dtype, {T, H});
    permuted = Buffer(dtype, {N, H});
    permuted_probs = Buffer(DType::kFloat32, {N});
    indices = Buffer(DType::kInt64, {N});
    restored = Buffer(dtype, {T, H});
    std::vector<float> row(static_cast<size_t>(T * H));
    for (auto& v : row) v = d(rng);
    convert_from_f32(row.data(), tokens.data(), dtype, T * H);
    moe::permute(tokens, map, &probs.view(), N, false, moe::Method::kFused, permuted, &permuted_probs.view(), indices);
  }
};

void BM_Permute(benchmark::State& state) {
  Setup s(state.range(0) ? DType::kBFloat16 : DType::kFloat32, state.range(2) != 0);
  const auto method = state.range(1) ? moe::Method::kFused : moe::Method::kSort;
  for (auto _ : state)
    moe::permute(s.tokens, s.map, &s.probs.view(), s.N, false, method, s.permuted, &s.permuted_probs.view(), s.indices);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(s.tokens.nbytes() + s.permuted.nbytes()));
}

void BM_Unpermute(benchmark::State& state) {
  Setup s(state.range(0) ? DType::kBFloat16 : DType::kFloat32, state.range(2) != 0);
  const auto method = state.range(1) ? moe::Method::kFused : moe::Method::kSort;
  for (auto _ : state)
    moe::unpermute(s.permuted, s.indices, s.restored, &s.permuted_probs.view(), nullptr, false, method);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(s.restored.nbytes() + s.permuted.nbytes()));
}

// Args: {bf16?, fused?, small?}
BENCHMARK(BM_Permute)->Args({0, 1, 0})->Args({1, 1, 0})->Args({0, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Unpermute)->Args({0, 1, 0})->Args({1, 1, 0})->Args({0, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Permute)->Args({1, 1, 1})->Args({1, 0, 1})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Unpermute)->Args({1, 1, 1})->Args({1, 0, 1})->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
