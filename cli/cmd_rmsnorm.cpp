// `leanstep bench rmsnorm`: the fused RMSNorm against the reference and against
// the machine's copy bandwidth (the floor for an op that must move its bytes).
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "leanstep/bench.h"
#include "leanstep/buffer.h"
#include "leanstep/rmsnorm.h"
#include "output.h"

namespace leanstep::cli {
namespace {

namespace rn = leanstep::rmsnorm;

struct RmsNormBenchOptions {
  bool json = false;
  bool quick = false;
  bool skip_reference = false;
};

struct BenchCase {
  int64_t rows, hidden;
  DType dtype;
  std::string name() const {
    return fmt::format("{}x{}_{}", rows, hidden, dtype == DType::kFloat32 ? "fp32" : "bf16");
  }
};

// Fast reproducible fill (normal-ish values via a float vector converted once).
void fill(const Tensor& t, uint64_t seed, float mean, float scale) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> pool(4099);
  for (float& v : pool) v = mean + scale * dist(rng);
  std::vector<float> buf(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = pool[(i * 7919) % pool.size()];
  convert_from_f32(buf.data(), t.data, t.dtype, t.numel());
}

using Row = BenchRow;

// Median over `pairs` of t(a)/t(b), a and b timed back to back (ABAB...): on a
// shared, noisy machine slow stretches hit both members of a pair alike, so the
// paired ratio is far steadier than a ratio of separately measured medians.
double paired_ratio(const std::function<void()>& a, const std::function<void()>& b, int pairs) {
  using clock = std::chrono::steady_clock;
  auto once = [](const std::function<void()>& f) {
    const auto t0 = clock::now();
    f();
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  a();
  b();
  std::vector<double> ratios;
  for (int k = 0; k < pairs; ++k) {
    const double ta = once(a);
    ratios.push_back(ta / once(b));
  }
  return bench::median(ratios);
}

void run_rmsnorm_bench(const RmsNormBenchOptions& o) {
  Progress progress(1 + 4 * 8, true);  // bandwidth + 4 cases x 4 ops x 2 variants
  progress.step("copy bandwidth");
  const auto bw = bench::measure_bandwidth(bench::Access::kCopy, o.quick ? size_t{128} << 20 : size_t{256} << 20);
  if (o.json) print_json_line(bandwidth_record("rmsnorm", bw));
  const double copy_gbps = bw.gbps();

  const std::vector<BenchCase> cases = {{8192, 2048, DType::kFloat32}, {8192, 2048, DType::kBFloat16},
                                        {4096, 5120, DType::kFloat32}, {4096, 5120, DType::kBFloat16}};
  const int min_reps = o.quick ? 3 : 9;
  const double min_seconds = o.quick ? 0.05 : 0.4;
  std::vector<Row> rows;
  std::vector<std::pair<std::string, double>> frozen_over_trainable;  // per case, paired
  const int pairs = o.quick ? 7 : 21;
  for (const BenchCase& c : cases) {
    const int64_t n = c.rows * c.hidden;
    const double es = static_cast<double>(dtype_size(c.dtype));
    Buffer x(c.dtype, {c.rows, c.hidden}), gamma(c.dtype, {c.hidden}), y(c.dtype, {c.rows, c.hidden});
    Buffer dy(c.dtype, {c.rows, c.hidden}), dx(c.dtype, {c.rows, c.hidden}), dgamma(c.dtype, {c.hidden});
    Buffer rstd(DType::kFloat32, {c.rows});
    fill(x, 1, 0.0f, 1.0f);
    fill(gamma, 2, 1.0f, 0.1f);
    fill(dy, 3, 0.0f, 1.0f);
    rn::forward_fused(x, gamma, y, rstd, {});

    // Minimal bytes each op must move (every input read once, every output
    // written once; the fused kernels' scratch rows and dgamma chunk partials
    // are not counted).
    const double row_stats = 4.0 * static_cast<double>(c.rows);
    const double weight = es * static_cast<double>(c.hidden);
    const double act = es * static_cast<double>(n);
    const double fwd_bytes = act + weight + act + row_stats;                  // x, gamma -> y, rstd
    const double bwd_frozen_bytes = act + act + row_stats + weight + act;     // dy, x, rstd, gamma -> dx
    const double bwd_trainable_bytes = bwd_frozen_bytes + weight;             // + dgamma
    const double fwd_bwd_bytes = fwd_bytes + bwd_frozen_bytes;                // x read twice

    struct Op {
      const char* op;
      double bytes;
      std::function<void()> reference, fused;
    };
    const Tensor* dg = &dgamma.view();
    const std::vector<Op> ops = {
        {"forward", fwd_bytes, [&] { rn::forward_reference(x, gamma, y, rstd, {}); },
         [&] { rn::forward_fused(x, gamma, y, rstd, {}); }},
        {"backward_frozen", bwd_frozen_bytes, [&] { rn::backward_reference(dy, x, rstd, gamma, dx, nullptr, {}); },
         [&] { rn::backward_fused(dy, x, rstd, gamma, dx, nullptr, {}); }},
        {"backward_trainable", bwd_trainable_bytes, [&] { rn::backward_reference(dy, x, rstd, gamma, dx, dg, {}); },
         [&] { rn::backward_fused(dy, x, rstd, gamma, dx, dg, {}); }},
        {"fwd_bwd_frozen", fwd_bwd_bytes,
         [&] {
           rn::forward_reference(x, gamma, y, rstd, {});
           rn::backward_reference(dy, x, rstd, gamma, dx, nullptr, {});
         },
         [&] {
           rn::forward_fused(x, gamma, y, rstd, {});
           rn::backward_fused(dy, x, rstd, gamma, dx, nullptr, {});
         }},
    };
    for (const Op& op : ops) {
      for (const char* variant : {"reference", "fused"}) {
        const bool is_ref = std::string(variant) == "reference";
        progress.step(fmt::format("{} {} {}", c.name(), op.op, variant));
        if (is_ref && o.skip_reference) continue;
        // The single-threaded reference is slow: fewer repetitions suffice.
        const auto t = is_ref ? bench::time_it(op.reference, o.quick ? 1 : 3, 0.0, 1)
                              : bench::time_it(op.fused, min_reps, min_seconds, 2);
        rows.push_back({c.name(), op.op, variant, t.median_ms, op.bytes});
        if (o.json) {
          auto rec = bench_record("rmsnorm", c.name(), op.op, variant, t.median_ms, op.bytes);
          rec["floor_ms"] = op.bytes / (copy_gbps * 1e9) * 1e3;
          rec["x_floor"] = t.median_ms / (op.bytes / (copy_gbps * 1e9) * 1e3);
          rec["threads"] = num_threads();
          print_json_line(rec);
        }
      }
    }
    const double ratio = paired_ratio(ops[1].fused, ops[2].fused, pairs);
    frozen_over_trainable.emplace_back(c.name(), ratio);
    if (o.json) {
      print_json_line({{"bench", "rmsnorm"}, {"case", c.name()}, {"op", "backward_frozen/backward_trainable"},
                       {"variant", "fused"}, {"paired_ratio", ratio}, {"pairs", pairs}});
    }
  }
  progress.done();
  if (o.json) return;

  std::printf("copy bandwidth: %.1f GB/s (%d threads, %s buffers); floor = minimal bytes / copy bandwidth\n\n",
              copy_gbps, num_threads(), o.quick ? "128 MiB" : "256 MiB");
  print_bench_table(rows, copy_gbps, "reference");
  std::printf("\ngoals (fused):\n");
  for (const BenchCase& c : cases) {
    const Row* fb = find_bench_row(rows, c.name(), "fwd_bwd_frozen", "fused");
    const Row* bf = find_bench_row(rows, c.name(), "backward_frozen", "fused");
    const Row* bt = find_bench_row(rows, c.name(), "backward_trainable", "fused");
    if (!fb || !bf || !bt) continue;
    const double x_floor = fb->median_ms / (fb->bytes / (copy_gbps * 1e9) * 1e3);
    double ratio = 0;
    for (const auto& [name, value] : frozen_over_trainable)
      if (name == c.name()) ratio = value;
    std::printf("  %-16s frozen fwd+bwd %.2fx floor (goal <= 1.3x: %s); frozen backward %.2f ms vs trainable %.2f ms; "
                "paired frozen/trainable %.2f (%.0f%% cheaper, %d pairs)\n",
                c.name().c_str(), x_floor, x_floor <= 1.3 ? "met" : "NOT met", bf->median_ms, bt->median_ms, ratio,
                100.0 * (1.0 - ratio), pairs);
    if (c.name().find("x5120") == std::string::npos) continue;
    // The wide-hidden goal: every pass within 1.2x of the floor.
    std::string line;
    bool met = true;
    for (const char* op : {"forward", "backward_frozen", "backward_trainable", "fwd_bwd_frozen"}) {
      const Row* r = find_bench_row(rows, c.name(), op, "fused");
      if (!r) continue;
      const double x = r->median_ms / (r->bytes / (copy_gbps * 1e9) * 1e3);
      met = met && x <= 1.2;
      line += fmt::format("{}{} {:.2f}x", line.empty() ? "" : ", ", op, x);
    }
    std::printf("  %-16s %s (goal <= 1.2x of the floor at H=5120: %s)\n", c.name().c_str(), line.c_str(),
                met ? "met" : "NOT met");
  }
}

}  // namespace

void add_rmsnorm_commands(Context& ctx) {
  auto opts = std::make_shared<RmsNormBenchOptions>();
  auto* cmd = ctx.bench.add_subcommand(
      "rmsnorm", "RMSNorm forward/backward (frozen and trainable): fused vs reference vs the copy-bandwidth floor");
  cmd->add_flag("--json", opts->json, "One JSON line per result (bench, case, op, variant, median_ms, bytes, gbps)");
  cmd->add_flag("--quick", opts->quick, "Fewer repetitions (a smoke run; figures are noisier)");
  cmd->add_flag("--no-reference", opts->skip_reference, "Skip the slow single-threaded reference");
  cmd->callback([opts] { run_rmsnorm_bench(*opts); });
}

}  // namespace leanstep::cli
