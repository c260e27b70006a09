// `leanstep bench grad` and `leanstep demo`: the fused gradient engine against
// the per-tensor reference path and the machine's memory bandwidth, on
// (a) one rank of Qwen3-Omni-30B-A3B LoRA fine-tuning and (b) a dense ~100M
// fp32 model under the distributed optimizer.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "leanstep/bench.h"
#include "fixtures/model_layouts.h"
#include "leanstep/grad.h"
#include "leanstep/buffer.h"
#include "leanstep/grad.h"
#include "leanstep/layout.h"
#include "leanstep/lora.h"
#include "output.h"

namespace leanstep::cli {
namespace {

struct GradBenchOptions {
  bool json = false;
  bool quick = false;
  std::string lora_config = "examples/models/qwen3-omni-30b-a3b-instruct.config.json";
};

// One benchmark layout: its DDP buffers (fp32 grads), the grad views in
// registration order, and the plan.
struct BenchLayout {
  std::string name;
  std::string source;  // how the param list was obtained
  std::vector<layout::BufferLayout> buffers;
  std::vector<Buffer> storage;
  std::vector<Tensor> views;
  std::unique_ptr<grad::Plan> plan;
};

// Reproducible uniform(-1, 1) values, filled in parallel (splitmix64 per element).
void fill_random(float* p, int64_t n, uint64_t seed) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = static_cast<float>(static_cast<double>(z >> 11) * 0x1p-52 - 1.0);
  }
}

BenchLayout make_layout(std::string name, std::string source, const std::vector<layout::ParamSpec>& params,
                        const layout::LayoutOptions& options) {
  BenchLayout l;
  l.name = std::move(name);
  l.source = std::move(source);
  l.buffers = layout::build_ddp_buffers(params, options);
  uint64_t seed = 1;
  for (const auto& b : l.buffers) {
    l.storage.emplace_back(DType::kFloat32, std::vector<int64_t>{b.numel});
    fill_random(l.storage.back().data_as<float>(), b.numel, seed++);
    for (const Tensor& v : b.views(l.storage.back().data())) l.views.push_back(v);
  }
  l.plan = std::make_unique<grad::Plan>(l.views);
  return l;
}

// Layout (a). The LoRA planner (leanstep::lora) gives the adapters of EP rank 0
// from the model config when the config file is at hand; otherwise the same
// dimensions, hard-coded in leanstep::fixtures, are used.
std::vector<layout::ParamSpec> qwen3_omni_lora_params(const std::string& config_path, std::string& source) {
  if (std::filesystem::exists(config_path)) {
    const lora::ModelConfig config = lora::load_model_config(config_path);
    lora::PlanOptions o;
    o.targets = {"linear_qkv", "linear_fc1", "linear_fc2"};
    o.lora_rank = 8;
    o.parallel.ep = 8;
    const lora::Plan plan = lora::plan(config, o);
    std::vector<layout::ParamSpec> params;
    for (const auto& t : plan.ranks.front().layout())
      params.push_back({t.name, t.shape, t.dtype, t.name.find(".experts.") != std::string::npos});
    source = fmt::format("lora plan of {} (rank 8 on linear_qkv, linear_fc1, linear_fc2; EP 8; EP rank 0)",
                         std::filesystem::path(config_path).filename().string());
    return params;
  }
  source = "built-in Qwen3-Omni-30B-A3B thinker dims (config file not found: " + config_path + ")";
  return fixtures::qwen3_omni_lora_rank_params(8, 8);
}

BenchLayout lora_layout(const GradBenchOptions& o) {
  std::string source;
  const auto params = qwen3_omni_lora_params(o.lora_config, source);
  layout::LayoutOptions lo;
  lo.distributed_optimizer = true;  // LoRA runs commonly use it; adapters' sizes are multiples of 64
  lo.dp_size = 8;
  lo.bucket_size = 40'000'000;
  return make_layout("qwen3-omni-30b-a3b-lora-r8-ep8", source, params, lo);
}

BenchLayout dense_layout() {
  layout::LayoutOptions lo;
  lo.distributed_optimizer = true;
  lo.dp_size = 6;  // bucket ends padded to lcm(6, 128) = 384 elements
  lo.bucket_size = 40'000'000;
  return make_layout("dense-101m-fp32-distopt-dp6", "built-in GPT-style 101M (hidden 1024, 6 layers, vocab 25000)",
                     fixtures::dense_100m_params(), lo);
}

struct Result {
  std::string case_name, op, variant;
  double median_ms = 0, bytes = 0;
  bench::Access pattern;
};

// Times the four ops, fused and per-tensor, on one layout.
std::vector<Result> bench_layout(BenchLayout& l, const GradBenchOptions& o, Progress& progress) {
  const double n_bytes = static_cast<double>(l.plan->touched_bytes());
  const int min_reps = o.quick ? 3 : 7;
  const double min_seconds = o.quick ? 0.05 : 0.4;
  const int warmup = 1;
  Buffer norm(DType::kFloat32, {1}), found_inf(DType::kFloat32, {1}), coeff(DType::kFloat32, {1});
  // The true norm, then a max_norm just below it: every clip multiplies by a
  // coefficient just under 1 (values change, but never drift towards denormals
  // however many repetitions run).
  grad::norm(*l.plan, norm);
  const double max_norm = static_cast<double>(*norm.data_as<float>()) * (1.0 - 1e-6);
  // An inv_scale != 1 so unscale really multiplies (a real 1/65536 would drive
  // the values into denormals after a few repetitions).
  const float inv_scale = 1.0f - 0x1p-20f;
  Buffer inv(DType::kFloat32, {1});
  *inv.data_as<float>() = inv_scale;

  struct Op {
    const char* name;
    double bytes;
    bench::Access pattern;
    std::function<void()> fused, reference;
  };
  const std::vector<Op> ops = {
      {"norm", n_bytes, bench::Access::kRead, [&] { grad::norm(*l.plan, norm, 2.0, &found_inf.view()); },
       [&] { grad::reference::norm(l.views, norm, 2.0, &found_inf.view()); }},
      {"clip", 2 * n_bytes, bench::Access::kInPlace, [&] { grad::clip(*l.plan, norm, max_norm, &coeff.view()); },
       [&] { grad::reference::clip(l.views, norm, max_norm, &coeff.view()); }},
      {"unscale_norm", 2 * n_bytes, bench::Access::kInPlace,
       [&] { grad::unscale_norm(*l.plan, inv, norm, found_inf); },
       [&] { grad::reference::unscale_norm(l.views, inv, norm, found_inf); }},
      // bytes per the rule: grads read once, written once (2N). The
      // clip needs the finished norm, so the op is two dependent passes and
      // physically moves 3N.
      {"norm_clip", 2 * n_bytes, bench::Access::kCopy,
       [&] { grad::norm_clip(*l.plan, max_norm, norm, 2.0, &found_inf.view(), &coeff.view()); },
       [&] { grad::reference::norm_clip(l.views, max_norm, norm, 2.0, &found_inf.view(), &coeff.view()); }},
  };
  std::vector<Result> results;
  for (const Op& op : ops) {
    for (const char* variant : {"reference", "fused"}) {
      progress.step(fmt::format("{} {} {}", l.name, op.name, variant));
      const auto& fn = std::string(variant) == "fused" ? op.fused : op.reference;
      const auto t = bench::time_it(fn, min_reps, min_seconds, warmup);
      results.push_back({l.name, op.name, variant, t.median_ms, op.bytes, op.pattern});
    }
  }
  return results;
}

struct Bandwidths {
  std::map<bench::Access, bench::Bandwidth> by_access;
  double gbps(bench::Access a) const { return by_access.at(a).gbps(); }
};

Bandwidths measure_all(const GradBenchOptions& o, Progress& progress) {
  Bandwidths bw;
  const size_t bytes = o.quick ? size_t{128} << 20 : size_t{256} << 20;
  for (bench::Access a : {bench::Access::kCopy, bench::Access::kRead, bench::Access::kInPlace}) {
    progress.step(fmt::format("{} bandwidth", bench::access_name(a)));
    bw.by_access.emplace(a, bench::measure_bandwidth(a, bytes));
  }
  return bw;
}

void print_table(const std::vector<Result>& results, const Bandwidths& bw) {
  Table table({"case / op", "variant", "ms", "GB/s", "floor x", "vs copy floor x", "speedup"});
  std::map<std::string, double> reference_ms;
  for (const Result& r : results)
    if (r.variant == "reference") reference_ms[r.case_name + r.op] = r.median_ms;
  for (const Result& r : results) {
    const double gbps = r.bytes / (r.median_ms * 1e-3) / 1e9;
    const double floor_ms = r.bytes / (bw.gbps(r.pattern) * 1e9) * 1e3;
    const double copy_floor_ms = r.bytes / (bw.gbps(bench::Access::kCopy) * 1e9) * 1e3;
    const double speedup = reference_ms[r.case_name + r.op] / r.median_ms;
    table.add_row({fmt::format("{} / {}", r.case_name, r.op), r.variant, format_ms(r.median_ms), format_fixed(gbps, 2),
                   format_fixed(r.median_ms / floor_ms, 2), format_fixed(r.median_ms / copy_floor_ms, 2),
                   r.variant == std::string("fused") ? format_fixed(speedup, 2) + "x" : ""});
  }
  table.print();
  std::printf(
      "\nfloor x = median / (bytes / bandwidth of the matching access pattern: read for norm, in-place for clip and\n"
      "unscale_norm, copy for norm_clip); 1.00 = at the measured bandwidth. bytes = grads read once (+ written once\n"
      "for in-place ops); norm_clip counts 2N but needs two dependent passes (a read, then a read-write: 3N moved).\n"
      "reference = per-tensor path: one dispatch and one host read per tensor, scalar element loops.\n");
}

void print_layouts(const std::vector<BenchLayout>& layouts) {
  for (const BenchLayout& l : layouts) {
    std::printf("layout %s: %zu grads from %s\n", l.name.c_str(), l.views.size(), l.source.c_str());
    for (const auto& b : l.buffers) std::printf("  %s", b.summary().substr(0, b.summary().find('\n') + 1).c_str());
    std::printf("  %s", l.plan->summary().c_str());
  }
  std::printf("\n");
}

void run_grad_bench(const GradBenchOptions& o, bool demo) {
  std::vector<BenchLayout> layouts;
  layouts.push_back(lora_layout(o));
  if (!demo) layouts.push_back(dense_layout());
  Progress progress(3 + 8 * static_cast<int>(layouts.size()), !o.json);
  const Bandwidths bw = measure_all(o, progress);
  std::vector<Result> results;
  for (BenchLayout& l : layouts) {
    auto r = bench_layout(l, o, progress);
    results.insert(results.end(), r.begin(), r.end());
  }
  progress.done();
  if (o.json) {
    for (const auto& [access, b] : bw.by_access) print_json_line(bandwidth_record("grad", b));
    for (const Result& r : results) {
      auto rec = bench_record("grad", r.case_name, r.op, r.variant, r.median_ms, r.bytes);
      rec["pattern"] = bench::access_name(r.pattern);
      print_json_line(rec);
    }
    return;
  }
  print_layouts(layouts);
  std::printf("bandwidth (%d threads): copy %.2f GB/s, read %.2f GB/s, in-place %.2f GB/s\n\n", num_threads(),
              bw.gbps(bench::Access::kCopy), bw.gbps(bench::Access::kRead), bw.gbps(bench::Access::kInPlace));
  print_table(results, bw);
}

}  // namespace

void add_grad_commands(Context& ctx) {
  auto options = std::make_shared<GradBenchOptions>();
  auto* bench = ctx.bench.add_subcommand(
      "grad", "Gradient engine: fused norm/clip/unscale vs the per-tensor path, on a LoRA MoE and a dense layout");
  bench->add_flag("--json", options->json, "One JSON object per line (bench, case, op, variant, median_ms, bytes, gbps)");
  bench->add_flag("--quick", options->quick, "Few repetitions, smaller bandwidth buffers (a few seconds)");
  bench->add_option("--lora-config", options->lora_config, "Qwen3-Omni config.json for layout (a)")
      ->capture_default_str();
  bench->callback([options] { run_grad_bench(*options, /*demo=*/false); });

  auto demo_options = std::make_shared<GradBenchOptions>();
  demo_options->quick = true;
  auto* demo = ctx.root.add_subcommand(
      "demo", "Gradient engine demo: plan of a Qwen3-Omni LoRA rank, per-tensor vs fused timings");
  demo->add_option("--lora-config", demo_options->lora_config, "Qwen3-Omni config.json")->capture_default_str();
  demo->callback([demo_options] { run_grad_bench(*demo_options, /*demo=*/true); });
}

}  // namespace leanstep::cli
