// `leanstep bench moe`: token permutation to expert-major order and back, the
// reference ("sort") against the fused path, and both against the machine's copy
// bandwidth (the floor for an op that must move its bytes).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "leanstep/bench.h"
#include "leanstep/buffer.h"
#include "leanstep/moe.h"
#include "output.h"

namespace leanstep::cli {
namespace {

struct MoeBenchOptions {
  bool json = false;
  bool quick = false;
  bool skip_sort = false;
  int64_t tokens = 4096, experts = 128, topk = 8, hidden = 2048;
};

using Row = BenchRow;

void fill(const Tensor& t, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> pool(4099);
  for (float& v : pool) v = dist(rng);
  std::vector<float> buf(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = pool[(i * 7919) % pool.size()];
  convert_from_f32(buf.data(), t.data, t.dtype, t.numel());
}

void run_moe_bench(const MoeBenchOptions& o) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16};
  const int per_case = 5;
  Progress progress(2 + per_case * static_cast<int>(dtypes.size()), true);
  progress.step("copy bandwidth");
  const auto bw = bench::measure_bandwidth(bench::Access::kCopy, o.quick ? size_t{128} << 20 : size_t{256} << 20);
  if (o.json) print_json_line(bandwidth_record("moe", bw));
  const double copy_gbps = bw.gbps();

  const int64_t T = o.tokens, E = o.experts, k = o.topk, H = o.hidden;
  // A realistic routing: the router's top-k on random logits.
  progress.step("routing");
  Buffer logits(DType::kFloat32, {T, E});
  fill(logits, 7);
  moe::RoutingConfig cfg;
  cfg.topk = k;
  Buffer map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E}), tokens_per_expert(DType::kInt64, {E});
  moe::route(logits, cfg, nullptr, map, probs, tokens_per_expert);
  const int64_t N = moe::count_routed(map);

  const int min_reps = o.quick ? 3 : 9;
  const double min_seconds = o.quick ? 0.05 : 0.4;
  std::vector<Row> rows;
  for (DType dtype : dtypes) {
    const std::string case_name =
        fmt::format("T{}_E{}_k{}_H{}_{}", T, E, k, H, dtype == DType::kFloat32 ? "fp32" : "bf16");
    const double es = static_cast<double>(dtype_size(dtype));
    Buffer tokens(dtype, {T, H}), permuted(dtype, {N, H}), permuted_probs(DType::kFloat32, {N});
    Buffer indices(DType::kInt64, {N}), restored(dtype, {T, H}), copy_dst(dtype, {N, H});
    fill(tokens, 1);
    moe::permute(tokens, map, &probs.view(), N, false, moe::Method::kFused, permuted, &permuted_probs.view(), indices);

    // Minimal bytes: every input read once, every output written once.
    const double token_bytes = es * static_cast<double>(T * H), slot_bytes = es * static_cast<double>(N * H);
    const double map_bytes = static_cast<double>(T * E), index_bytes = 8.0 * static_cast<double>(N);
    const double permute_bytes = token_bytes + map_bytes + 4.0 * static_cast<double>(T * E)  // tokens, map, probs
                                 + slot_bytes + index_bytes + 4.0 * static_cast<double>(N);  // -> rows, indices, probs
    const double unpermute_bytes = slot_bytes + index_bytes + 4.0 * static_cast<double>(N) + token_bytes;
    const double copy_bytes = 2.0 * slot_bytes;

    struct Op {
      const char* op;
      const char* variant;
      double bytes;
      std::function<void()> fn;
    };
    std::vector<Op> ops;
    for (moe::Method method : {moe::Method::kSort, moe::Method::kFused}) {
      ops.push_back({"permute", moe::method_name(method), permute_bytes, [&, method] {
                       moe::permute(tokens, map, &probs.view(), N, false, method, permuted, &permuted_probs.view(),
                                    indices);
                     }});
      ops.push_back({"unpermute", moe::method_name(method), unpermute_bytes, [&, method] {
                       moe::unpermute(permuted, indices, restored, &permuted_probs.view(), nullptr, false, method);
                     }});
    }
    // The same bytes as the permuted rows, copied by all threads (the floor, measured per case).
    ops.push_back({"copy", "memcpy", copy_bytes, [&] {
                     const size_t row_bytes = static_cast<size_t>(H) * dtype_size(dtype);
                     const int64_t blocks = (N + 1023) / 1024;
#pragma omp parallel for schedule(static)
                     for (int64_t b = 0; b < blocks; ++b) {
                       const int64_t begin = b * 1024, end = std::min<int64_t>(N, begin + 1024);
                       std::memcpy(static_cast<char*>(copy_dst.data()) + static_cast<size_t>(begin) * row_bytes,
                                   static_cast<const char*>(permuted.data()) + static_cast<size_t>(begin) * row_bytes,
                                   static_cast<size_t>(end - begin) * row_bytes);
                     }
                   }});
    for (const Op& op : ops) {
      progress.step(fmt::format("{} {} {}", case_name, op.op, op.variant));
      const bool is_sort = std::string(op.variant) == "sort";
      if (is_sort && o.skip_sort) continue;
      // The serial reference is slow: fewer repetitions suffice.
      const auto t = is_sort ? bench::time_it(op.fn, o.quick ? 1 : 3, 0.0, 1) : bench::time_it(op.fn, min_reps, min_seconds, 2);
      rows.push_back({case_name, op.op, op.variant, t.median_ms, op.bytes});
      if (o.json) {
        auto rec = bench_record("moe", case_name, op.op, op.variant, t.median_ms, op.bytes);
        const double floor_ms = op.bytes / (copy_gbps * 1e9) * 1e3;
        rec["floor_ms"] = floor_ms;
        rec["x_floor"] = t.median_ms / floor_ms;
        rec["threads"] = num_threads();
        rec["routed_pairs"] = N;
        print_json_line(rec);
      }
    }
  }
  progress.done();
  if (o.json) return;

  std::printf("copy bandwidth: %.1f GB/s (%d threads, %s buffers); floor = minimal bytes / copy bandwidth\n",
              copy_gbps, num_threads(), o.quick ? "128 MiB" : "256 MiB");
  std::printf("T=%lld E=%lld k=%lld H=%lld: %lld routed pairs\n\n", static_cast<long long>(T),
              static_cast<long long>(E), static_cast<long long>(k), static_cast<long long>(H), static_cast<long long>(N));
  print_bench_table(rows, copy_gbps, "sort");
  std::printf("\ngoal: fused permute and unpermute within 1.5x of the floor\n");
  for (const Row& r : rows)
    if (r.variant == std::string("fused")) {
      const double x = r.median_ms / (r.bytes / (copy_gbps * 1e9) * 1e3);
      std::printf("  %-28s %-10s %.2fx floor  %s\n", r.case_name.c_str(), r.op.c_str(), x, x <= 1.5 ? "met" : "NOT met");
    }
}

}  // namespace

void add_moe_commands(Context& ctx) {
  auto opts = std::make_shared<MoeBenchOptions>();
  auto* cmd = ctx.bench.add_subcommand(
      "moe", "MoE token permute/unpermute: sort (reference) vs fused vs the copy bandwidth");
  cmd->add_flag("--json", opts->json, "One JSON line per measurement (bench, case, op, variant, median_ms, bytes, gbps)");
  cmd->add_flag("--quick", opts->quick, "Fewer repetitions and a smaller bandwidth buffer");
  cmd->add_flag("--skip-sort", opts->skip_sort, "Skip the slow serial reference");
  cmd->add_option("--tokens", opts->tokens, "Tokens T")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--experts", opts->experts, "Experts E")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--topk", opts->topk, "Experts per token k")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--hidden", opts->hidden, "Hidden size H")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->callback([opts] { run_moe_bench(*opts); });
}

}  // namespace leanstep::cli
