// Output helpers shared by the subcommands: readable tables for people,
// JSON lines for machines, and a progress line on long runs.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/bench.h"
#include "leanstep/table.h"

namespace leanstep::cli {

// Readable tables (defined in core so areas can format reports too).
using Table = leanstep::TextTable;

// Prints one JSON object on one line to stdout and flushes.
void print_json_line(const nlohmann::json& obj);

// One benchmark result in the common line format:
// {bench, case, op, variant, median_ms, bytes, gbps}.
nlohmann::json bench_record(const std::string& bench, const std::string& case_name,
                            const std::string& op, const std::string& variant,
                            double median_ms, double bytes);
// The bandwidth line ("copy", "read" or "inplace" op, variant "stream").
nlohmann::json bandwidth_record(const std::string& bench, const leanstep::bench::Bandwidth& bw);

// A progress line on stderr ("[3/10] what"), rewritten in place on a terminal,
// one line per update otherwise. Silent when disabled (e.g. under --json with --quiet).
class Progress {
 public:
  Progress(int total, bool enabled = true);
  void step(const std::string& what);
  void done();

 private:
  int total_;
  int current_ = 0;
  bool enabled_;
  bool tty_;
};

// One timed benchmark row of a `leanstep bench <area>` run.
struct BenchRow {
  std::string case_name, op, variant;
  double median_ms = 0, bytes = 0;
};
const BenchRow* find_bench_row(const std::vector<BenchRow>& rows, const std::string& case_name, const std::string& op,
                               const std::string& variant);
// The readable table of rows against the copy-bandwidth floor (floor = bytes / copy
// bandwidth), with the "fused" rows' speedup over the `baseline_variant` row of the same
// case and op.
void print_bench_table(const std::vector<BenchRow>& rows, double copy_gbps, const std::string& baseline_variant);

// An option check for whole numbers in [min, max]: "--pp-first: must be >= 0 (got -5)".
CLI::Validator integer_in(int64_t min, int64_t max, const std::string& max_text = "");

std::string format_ms(double ms);
std::string format_fixed(double value, int decimals);

}  // namespace leanstep::cli
