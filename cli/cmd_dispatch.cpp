// `leanstep paths`: the dispatch registry's ops, implementations, guards,
// preset, and (after calls in this process) who ran and why not the fast path.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <thread>

#include "commands.h"
#include "leanstep/bench.h"
#include "leanstep/buffer.h"
#include "leanstep/dispatch.h"
#include "leanstep/ops.h"
#include "output.h"

namespace leanstep::cli {
namespace {

void fill(const Tensor& t, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data, t.dtype, i, dist(rng));
}

// A few small calls through every entry point, chosen so that every guard
// both accepts and declines at least once; the counters then show routing.
void run_demo_calls() {
  std::mt19937_64 rng(1234);
  // RMSNorm: trainable forward, frozen backward, trainable backward, and a
  // call with a delegated feature (autocast) that goes to the reference.
  {
    const int64_t rows = 8, h = 64;
    Buffer x(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h}), y(DType::kBFloat16, {rows, h}),
        rstd(DType::kFloat32, {rows}), dy(DType::kBFloat16, {rows, h}), dx(DType::kBFloat16, {rows, h}),
        dgamma(DType::kBFloat16, {h});
    fill(x, rng);
    fill(gamma, rng);
    fill(dy, rng);
    const Tensor dgamma_view = dgamma.view();
    rmsnorm::CallContext trainable, frozen, autocast;
    frozen.weight_requires_grad = false;
    autocast.weight_requires_grad = false;
    autocast.autocast = true;
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, trainable);
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, frozen);
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, autocast);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, nullptr, {}, frozen);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, &dgamma_view, {}, trainable);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, nullptr, {}, autocast);
  }
  // Gradients: a flat buffer of three params (one coalesced region) and a plan
  // of strided views (no region: the fused path declines).
  {
    Buffer flat(DType::kFloat32, {1000});
    fill(flat, rng);
    float* p = flat.data_as<float>();
    const std::vector<Tensor> views = {Tensor(p, DType::kFloat32, {600}), Tensor(p + 600, DType::kFloat32, {300}),
                                       Tensor(p + 900, DType::kFloat32, {100})};
    const grad::Plan plan(views);
    Tensor strided(p, DType::kFloat32, {500});
    strided.strides[0] = 2;
    const grad::Plan strided_plan(std::vector<Tensor>{strided});
    Buffer norm(DType::kFloat32, {1}), found_inf(DType::kFloat32, {1}), coeff(DType::kFloat32, {1}),
        zeros(DType::kInt64, {1}), one(DType::kFloat32, {1});
    one.data_as<float>()[0] = 1.0f;
    const Tensor found_view = found_inf.view(), coeff_view = coeff.view();
    ops::grad_unscale_norm(plan, one, norm, found_inf);
    ops::grad_norm_clip(plan, 1.0, norm, 2.0, &found_view, &coeff_view);
    ops::grad_norm(strided_plan, norm);
    ops::grad_clip(strided_plan, norm, 1.0);
    ops::grad_count_zeros(plan, zeros);
    ops::grad_scale(plan, one);
    ops::grad_multi_tensor_scale(views, views, one, found_inf);
  }
  // MoE: permute 16 tokens to 4 experts (top-2), unpermute, and their backward.
  {
    const int64_t T = 16, E = 4, H = 32, k = 2;
    Buffer tokens(DType::kBFloat16, {T, H}), map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E});
    fill(tokens, rng);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        map.data_as<uint8_t>()[t * E + (t + j) % E] = 1;
        probs.data_as<float>()[t * E + (t + j) % E] = 0.5f;
      }
    const int64_t n = T * k;
    Buffer permuted(DType::kBFloat16, {n, H}), permuted_probs(DType::kFloat32, {n}), idx(DType::kInt64, {n}),
        out(DType::kBFloat16, {T, H}), dpermuted(DType::kBFloat16, {n, H}), dprobs(DType::kFloat32, {n});
    const Tensor probs_view = probs.view(), pp_view = permuted_probs.view(), dprobs_view = dprobs.view();
    ops::moe_permute(tokens, map, &probs_view, std::nullopt, false, permuted, &pp_view, idx);
    ops::moe_unpermute(permuted, idx, out, &pp_view);
    ops::moe_unpermute_backward(out, permuted, idx, &pp_view, nullptr, false, dpermuted, &dprobs_view);
    ops::moe_permute_backward(dpermuted, idx, out);
  }
}

// ---------------------------------------------------------------- bench dispatch

// Median milliseconds of `n` back-to-back calls of `fn`.
template <class Fn>
double loop_n(int64_t n, int min_reps, double min_seconds, Fn&& fn) {
  return bench::time_it([&] {
    for (int64_t i = 0; i < n; ++i) fn();
  }, min_reps, min_seconds).median_ms;
}

// Trivial bodies, kept out of line so the measurement is the call path itself.
[[gnu::noinline]] int64_t add_one(int64_t x) { return x + 1; }
[[gnu::noinline]] int64_t add_two(int64_t x) { return x + 2; }
[[gnu::noinline]] const char* never_decline(int64_t) { return nullptr; }
[[gnu::noinline]] const char* always_decline(int64_t) { return "declined by the benchmark"; }

struct BenchOptions {
  bool json = false;
  bool quick = false;
};

// What a dispatched call costs on top of the work: the snapshot load, the
// guards, the counters. Measured on a trivial op (the whole cost is overhead)
// and on small real calls (the overhead as a share of real work).
void run_bench(const BenchOptions& o) {
  const int min_reps = o.quick ? 3 : 9;
  const double min_seconds = o.quick ? 0.05 : 0.3;
  const int64_t calls = o.quick ? 20000 : 200000;
  Table table({"case", "variant", "ns/call", "vs direct"});
  auto report = [&](const std::string& case_name, const std::string& variant, double median_ms, int64_t n,
                    double direct_ns) {
    const double ns = median_ms * 1e6 / static_cast<double>(n);
    if (o.json) {
      auto rec = bench_record("dispatch", case_name, "call", variant, median_ms, 0.0);
      rec["calls"] = n;
      rec["ns_per_call"] = ns;
      print_json_line(rec);
    }
    table.add_row({case_name, variant, format_fixed(ns, 1), direct_ns > 0 ? format_fixed(ns / direct_ns, 2) + "x" : "1.00x"});
    return ns;
  };
  volatile int64_t sink = 0;
  auto loop = [&](auto&& call) {
    return bench::time_it([&] {
      int64_t acc = 0;
      for (int64_t i = 0; i < calls; ++i) acc += call(i);
      sink = sink + acc;
    }, min_reps, min_seconds);
  };

  // A trivial op: direct call through a function pointer, then through slots.
  dispatch::Op<int64_t(int64_t)> plain("bench.plain", "reference", &add_one);
  plain.install("fast", &add_two);
  dispatch::Op<int64_t(int64_t)> guarded("bench.guarded", "reference", &add_one);
  guarded.install("fast", &add_two, &never_decline, "accepts all");
  dispatch::Op<int64_t(int64_t)> declined("bench.declined", "reference", &add_one);
  declined.install("fast", &add_two, &always_decline, "declines all");
  int64_t (*volatile direct_fn)(int64_t) = &add_two;
  const double direct = report("trivial", "direct", loop([&](int64_t i) { return direct_fn(i); }).median_ms, calls, 0);
  report("trivial", "slot", loop([&](int64_t i) { return plain(i); }).median_ms, calls, direct);
  report("trivial", "slot+guard", loop([&](int64_t i) { return guarded(i); }).median_ms, calls, direct);
  report("trivial", "slot+decline", loop([&](int64_t i) { return declined(i); }).median_ms, calls, direct);
  {
    // Every thread calling the same slot at once (the snapshot lock is shared).
    const int threads = std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
    const auto t = bench::time_it([&] {
      std::vector<std::thread> pool;
      for (int k = 0; k < threads; ++k)
        pool.emplace_back([&] {
          int64_t acc = 0;
          for (int64_t i = 0; i < calls; ++i) acc += plain(i);
          sink = sink + acc;
        });
      for (auto& th : pool) th.join();
    }, min_reps, min_seconds);
    report(fmt::format("trivial, {} threads", threads), "slot", t.median_ms, calls, direct);
  }

  // Small real calls: the overhead as a share of the work.
  std::mt19937_64 rng(7);
  {
    const int64_t rows = 4, h = 2048;
    Buffer x(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h}), y(DType::kBFloat16, {rows, h}),
        rstd(DType::kFloat32, {rows});
    fill(x, rng);
    fill(gamma, rng);
    const int64_t n = calls / 100;
    const auto d = loop_n(n, min_reps, min_seconds, [&] { rmsnorm::forward_fused(x, gamma, y, rstd, {}); });
    const double dns = report("rmsnorm.forward bf16[4,2048]", "direct fused", d, n, 0);
    report("rmsnorm.forward bf16[4,2048]", "ops:: (fused)",
           loop_n(n, min_reps, min_seconds, [&] { ops::rmsnorm_forward(x, gamma, y, rstd); }), n, dns);
  }
  {
    Buffer flat(DType::kFloat32, {4096});
    fill(flat, rng);
    const std::vector<Tensor> views = {Tensor(flat.data(), DType::kFloat32, {4096})};
    const grad::Plan plan(views);
    Buffer norm(DType::kFloat32, {1});
    const int64_t n = calls / 100;
    const auto d = loop_n(n, min_reps, min_seconds, [&] { grad::norm(plan, norm); });
    const double dns = report("grad.norm fp32[4096]", "direct fused", d, n, 0);
    report("grad.norm fp32[4096]", "ops:: (fused)", loop_n(n, min_reps, min_seconds, [&] { ops::grad_norm(plan, norm); }),
           n, dns);
  }
  if (o.json) return;
  table.print();
  std::printf("\nns/call: median over repetitions of %lld calls (real ops: %lld); %d threads for the kernels.\n",
              static_cast<long long>(calls), static_cast<long long>(calls / 100), num_threads());
}

}  // namespace

void add_dispatch_commands(Context& ctx) {
  {
    auto opts = std::make_shared<BenchOptions>();
    auto* cmd = ctx.bench.add_subcommand("dispatch", "Per-call cost of dispatching through an op slot");
    cmd->add_flag("--json", opts->json, "One JSON line per measurement (common fields plus calls, ns_per_call)");
    cmd->add_flag("--quick", opts->quick, "Fewer calls and repetitions");
    cmd->callback([opts] { run_bench(*opts); });
  }
  struct Args {
    bool json = false;
    bool demo_calls = false;
    std::string preset;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = ctx.root.add_subcommand(
      "paths", "List dispatched ops, their implementations and guards, the preset, and call counts");
  cmd->add_flag("--json", args->json, "One JSON object instead of the readable report");
  cmd->add_flag("--demo-calls", args->demo_calls,
                "Run a few small calls through every op first, so counts and decline reasons show");
  cmd->add_option("--preset", args->preset,
                  "Select implementations first: baseline, all, or op names/groups (e.g. rmsnorm,grad.clip)");
  cmd->callback([args] {
    auto& reg = dispatch::registry();
    if (!args->preset.empty()) reg.set_preset(args->preset);
    if (args->demo_calls) run_demo_calls();
    if (args->json) std::printf("%s\n", dispatch::paths_json(reg).c_str());
    else std::fputs(dispatch::paths_text(reg).c_str(), stdout);
  });
}

}  // namespace leanstep::cli
