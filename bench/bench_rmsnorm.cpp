// Kernel-level RMSNorm benchmarks (Google Benchmark) on one thread and
// cache-resident rows: the compute cost per element of each fused kernel. The
// "CPU" column is the thread's CPU time, which stays meaningful on a shared
// machine where wall-clock figures are dominated by other processes. The
// user-facing comparison with the bandwidth floor is `leanstep bench rmsnorm`.
#include <benchmark/benchmark.h>

#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/rmsnorm.h"

namespace {

using leanstep::Buffer;
using leanstep::DType;
namespace rn = leanstep::rmsnorm;

struct Inputs {
  Inputs(DType dt, int64_t rows, int64_t h)
      : x(dt, {rows, h}), gamma(dt, {h}), y(dt, {rows, h}), dy(dt, {rows, h}), dx(dt, {rows, h}), dgamma(dt, {h}),
        rstd(DType::kFloat32, {rows}) {
    std::vector<float> v(static_cast<size_t>(rows * h));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 17) * 0.1f - 0.8f;
    leanstep::convert_from_f32(v.data(), x.data(), dt, rows * h);
    leanstep::convert_from_f32(v.data(), dy.data(), dt, rows * h);
    leanstep::convert_from_f32(v.data(), gamma.data(), dt, h);
    rn::forward_fused(x, gamma, y, rstd, {});
  }
  Buffer x, gamma, y, dy, dx, dgamma, rstd;
};

// ~0.5 MiB per activation tensor in bf16: the working set stays in L2/L3.
constexpr int64_t kElements = int64_t{1} << 18;

template <DType kDType, int kOp>
void BM_RmsNorm(benchmark::State& state) {
  leanstep::set_num_threads(1);
  const int64_t h = state.range(0);
  Inputs in(kDType, kElements / h, h);
  for (auto _ : state) {
    if constexpr (kOp == 0) rn::forward_fused(in.x, in.gamma, in.y, in.rstd, {});
    if constexpr (kOp == 1) rn::backward_fused(in.dy, in.x, in.rstd, in.gamma, in.dx, nullptr, {});
    if constexpr (kOp == 2) rn::backward_fused(in.dy, in.x, in.rstd, in.gamma, in.dx, &in.dgamma.view(), {});
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_element"] =
      benchmark::Counter(static_cast<double>(kElements), benchmark::Counter::kIsIterationInvariantRate |
                                                             benchmark::Counter::kInvert);
}

#define RMSNORM_BENCH(dtype, op, name) \
  BENCHMARK(BM_RmsNorm<dtype, op>)->Name(name)->Arg(256)->Arg(2048)->Arg(5120)->Unit(benchmark::kMicrosecond)

RMSNORM_BENCH(DType::kFloat32, 0, "forward/fp32");
RMSNORM_BENCH(DType::kBFloat16, 0, "forward/bf16");
RMSNORM_BENCH(DType::kFloat32, 1, "backward_frozen/fp32");
RMSNORM_BENCH(DType::kBFloat16, 1, "backward_frozen/bf16");
RMSNORM_BENCH(DType::kFloat32, 2, "backward_trainable/fp32");
RMSNORM_BENCH(DType::kBFloat16, 2, "backward_trainable/bf16");

}  // namespace
