// Google Benchmark programs for kernel work on the gradient engine (the
// comparison users read is `leanstep bench grad`). Layout: one Qwen3-Omni
// LoRA rank (3168 fp32 grads) at rank-2 adapters (~10.5M elements).
#include <benchmark/benchmark.h>

#include <memory>

#include "fixtures/model_layouts.h"
#include "leanstep/grad.h"
#include "leanstep/buffer.h"
#include "leanstep/grad.h"
#include "leanstep/layout.h"

namespace {
using namespace leanstep;

struct Fixture {
  std::vector<Buffer> storage;
  std::vector<Tensor> views;
  std::unique_ptr<grad::Plan> plan;
  Buffer norm{DType::kFloat32, {1}}, flag{DType::kFloat32, {1}};
  Fixture() {
    layout::LayoutOptions o;
    o.distributed_optimizer = true;
    for (const auto& b : layout::build_ddp_buffers(fixtures::qwen3_omni_lora_rank_params(2), o)) {
      storage.emplace_back(DType::kFloat32, std::vector<int64_t>{b.numel});
      float* p = storage.back().data_as<float>();
      for (int64_t i = 0; i < b.numel; ++i) p[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
      for (const Tensor& v : b.views(storage.back().data())) views.push_back(v);
    }
    plan = std::make_unique<grad::Plan>(views);
  }
  double bytes() const { return static_cast<double>(plan->touched_bytes()); }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_NormFused(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) grad::norm(*f.plan, f.norm, 2.0, &f.flag.view());
  state.SetBytesProcessed(static_cast<int64_t>(f.bytes()) * state.iterations());
}
void BM_NormReference(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) grad::reference::norm(f.views, f.norm, 2.0, &f.flag.view());
  state.SetBytesProcessed(static_cast<int64_t>(f.bytes()) * state.iterations());
}
void BM_UnscaleNormFused(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) grad::unscale_norm(*f.plan, 1.0f - 0x1p-20f, f.norm, f.flag);
  state.SetBytesProcessed(2 * static_cast<int64_t>(f.bytes()) * state.iterations());
}
void BM_NormInfFused(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) grad::norm(*f.plan, f.norm, grad::kInfNorm);
  state.SetBytesProcessed(static_cast<int64_t>(f.bytes()) * state.iterations());
}

BENCHMARK(BM_NormFused)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_NormReference)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_UnscaleNormFused)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_NormInfFused)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
