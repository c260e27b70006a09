#include "output.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <iostream>

namespace leanstep::cli {

void print_json_line(const nlohmann::json& obj) {
  std::cout << obj.dump() << std::endl;
}

nlohmann::json bench_record(const std::string& bench, const std::string& case_name, const std::string& op,
                            const std::string& variant, double median_ms, double bytes) {
  return {{"bench", bench},         {"case", case_name}, {"op", op},
          {"variant", variant},     {"median_ms", median_ms}, {"bytes", bytes},
          {"gbps", median_ms > 0 ? bytes / (median_ms * 1e-3) / 1e9 : 0.0}};
}

nlohmann::json bandwidth_record(const std::string& bench, const leanstep::bench::Bandwidth& bw) {
  auto rec = bench_record(bench, "machine", leanstep::bench::access_name(bw.access), "stream",
                          bw.timing.median_ms, bw.bytes_moved);
  rec["buffer_bytes"] = bw.buffer_bytes;
  return rec;
}

Progress::Progress(int total, bool enabled) : total_(total), enabled_(enabled), tty_(isatty(2)) {}

void Progress::step(const std::string& what) {
  ++current_;
  if (!enabled_) return;
  if (tty_) std::fprintf(stderr, "\r\033[K[%d/%d] %s", current_, total_, what.c_str());
  else std::fprintf(stderr, "[%d/%d] %s\n", current_, total_, what.c_str());
  std::fflush(stderr);
}

void Progress::done() {
  if (enabled_ && tty_) std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

const BenchRow* find_bench_row(const std::vector<BenchRow>& rows, const std::string& case_name, const std::string& op,
                               const std::string& variant) {
  for (const BenchRow& r : rows)
    if (r.case_name == case_name && r.op == op && r.variant == variant) return &r;
  return nullptr;
}

void print_bench_table(const std::vector<BenchRow>& rows, double copy_gbps, const std::string& baseline_variant) {
  Table table({"case", "op", "variant", "median ms", "GB/s", "% of copy", "x floor", "vs " + baseline_variant});
  for (const BenchRow& r : rows) {
    const double gbps = r.bytes / (r.median_ms * 1e-3) / 1e9;
    const double floor_ms = r.bytes / (copy_gbps * 1e9) * 1e3;
    const BenchRow* ref = find_bench_row(rows, r.case_name, r.op, baseline_variant);
    const std::string speedup =
        r.variant == "fused" && ref ? fmt::format("{:.1f}x faster", ref->median_ms / r.median_ms) : "";
    table.add_row({r.case_name, r.op, r.variant, format_ms(r.median_ms), format_fixed(gbps, 1),
                   format_fixed(100.0 * gbps / copy_gbps, 0) + "%", format_fixed(r.median_ms / floor_ms, 2), speedup});
  }
  table.print();
}

CLI::Validator integer_in(int64_t min, int64_t max, const std::string& max_text) {
  const std::string upper = max_text.empty() ? std::to_string(max) : max_text;
  return CLI::Validator(
      [min, max, upper](std::string& text) -> std::string {
        int64_t v = 0;
        const char* b = text.data();
        const char* e = b + text.size();
        if (b != e && *b == '+') ++b;
        const auto [p, ec] = std::from_chars(b, e, v);
        if (ec == std::errc::result_out_of_range || (ec == std::errc() && p == e && (v < min || v > max)))
          return v < min && ec == std::errc() ? fmt::format("must be >= {} (got {})", min, text)
                                              : fmt::format("must be in [{}, {}] (got {})", min, upper, text);
        if (ec != std::errc() || p != e) return fmt::format("must be a whole number (got '{}')", text);
        return std::string();
      },
      fmt::format("INT in [{}, {}]", min, upper));
}

std::string format_ms(double ms) { return ms < 1 ? fmt::format("{:.4f}", ms) : fmt::format("{:.3f}", ms); }
std::string format_fixed(double value, int decimals) { return fmt::format("{:.{}f}", value, decimals); }

}  // namespace leanstep::cli
