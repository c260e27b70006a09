// leanstep stats: step-time statistics and counterbalanced crossover.
//
// Implements the measurement method of the project (warm-up discarded, the
// slowest rank per step, windows that show stability, paired same-position
// ratios under a Latin-square crossover) as a C++ API used by the `leanstep
// steps` / `leanstep crossover` commands and by the training step.
//
// Step logs: one record per (run, rank, step) in JSON Lines or CSV with the
// same column names. See docs/stats.md for the format and every semantic
// choice (missing ranks, step positions, bootstrap).
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace leanstep::stats {

// ---------------------------------------------------------------- step logs

struct StepRecord {
  std::string run;                   // "" in a log: the file's stem (rank suffix removed)
  int rank = 0;
  int64_t step = 0;
  double duration_s = 0;             // finite and > 0
  std::string condition;             // "" when not recorded
  std::optional<int> block;          // crossover block index, when recorded
  std::optional<double> loss;        // may be non-finite (that is worth reporting)
  std::optional<double> grad_norm;
  std::string allocation;            // "" when not recorded
  // Other numeric fields of the record, such as per-phase durations ("optimizer_s"); the
  // crossover analysis reduces each of them as it does the step (max over ranks, paired
  // ratios). At most kMaxStepFields per record.
  std::map<std::string, double> fields;
  // Where the record came from ("file:line"), for messages; empty for records built in code.
  std::string origin;
};

// Reads step logs (".csv" -> CSV with a header line, anything else -> JSON Lines).
// A directory stands for its *.jsonl and *.csv files (sorted by name; not subdirectories).
// Malformed lines throw Error("<file>:<line>: ..."); a duplicate (run, rank, step)
// throws naming both places. Records missing `run` get the file's stem with a
// trailing ".rankN" / "_rankN" / "-rankN" removed, so per-rank files of one run join.
std::vector<StepRecord> read_step_logs(const std::vector<std::string>& paths);
std::vector<StepRecord> read_step_log(const std::string& path);
// Parses one log's text; `name` is used in messages and for the default run name.
std::vector<StepRecord> parse_step_log(const std::string& text, const std::string& name, bool csv);

// One JSON line (no newline) for a record. Non-finite loss / grad_norm are written as
// NaN / Infinity / -Infinity (Python's json convention; read back by read_step_log).
std::string format_step_record_json(const StepRecord& record);

// Appends records to a JSON Lines (or, for ".csv", CSV) log; each line is flushed so a
// crash leaves only whole lines. `write_step_log` truncates first.
void write_step_log(const std::string& path, const std::vector<StepRecord>& records);
void append_step_log(const std::string& path, const std::vector<StepRecord>& records);

// A JSON Lines writer kept open for a training loop (one line per record, flushed).
class StepLogWriter {
 public:
  explicit StepLogWriter(const std::string& path, bool append = false);
  ~StepLogWriter();
  StepLogWriter(const StepLogWriter&) = delete;
  StepLogWriter& operator=(const StepLogWriter&) = delete;
  void write(const StepRecord& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// Limits of step logs: step indices in [0, 2^62], ranks and blocks in [0, 2^31 - 1].
inline constexpr int64_t kMaxStep = int64_t{1} << 62;
inline constexpr size_t kMaxStepFields = 64;
// Missing steps are counted in full but listed only up to this many (a log with steps
// 0 and 10^9 must not list 10^9 numbers).
inline constexpr size_t kMaxListedSteps = 1000;

// ---------------------------------------------------------------- per-run series

// One run's per-step view: the step duration is the MAXIMUM over ranks.
struct StepSeries {
  std::string run;
  std::vector<int> ranks;               // ranks seen in the run (sorted)
  int64_t first_step = 0;               // positions are step - first_step
  // One entry per step index present for at least one rank, ascending.
  std::vector<int64_t> steps;
  std::vector<double> duration_s;       // max over the ranks present
  std::vector<int> slowest_rank;
  std::vector<bool> complete;           // every rank of the run logged this step
  std::vector<std::string> condition;   // per step ("" when not recorded)
  std::vector<int> block;               // per step (-1 when not recorded)
  std::vector<std::optional<double>> loss;       // mean over the ranks that logged it
  std::vector<std::optional<double>> grad_norm;  // mean over the ranks that logged it
  // Per other numeric field, per step: the maximum over ranks; NaN when a rank of the step
  // did not log it (the maximum is then unknown).
  std::map<std::string, std::vector<double>> fields;
  std::string allocation;
  // What is missing, reported and never filled:
  std::vector<int64_t> missing_steps;   // gaps in [first, last] logged by no rank (the first kMaxListedSteps)
  int64_t missing_step_count = 0;       // all of them
  std::vector<std::pair<int64_t, std::vector<int>>> incomplete;  // step -> missing ranks
};

// Groups records by run (in order of first appearance) and builds each run's series.
// Throws when one step of a run carries different conditions on different ranks.
std::vector<StepSeries> build_series(const std::vector<StepRecord>& records);

// ---------------------------------------------------------------- summaries

struct RunSummary {
  std::string run;
  int num_ranks = 0;
  int64_t steps_logged = 0;       // step indices present
  int64_t warmup = 0;
  int64_t steps_used = 0;         // complete steps after warm-up
  double mean_s = 0, median_s = 0, min_s = 0, max_s = 0, stddev_s = 0;
  int64_t window = 0;
  std::vector<double> windows;    // means of consecutive full windows of used steps
  int64_t loss_values = 0, grad_norm_values = 0;  // logged values (all ranks, all steps)
  bool loss_finite = true, grad_norm_finite = true;
  std::vector<int64_t> missing_steps;  // the first kMaxListedSteps
  int64_t missing_step_count = 0;
  std::vector<std::pair<int64_t, std::vector<int>>> incomplete;
  std::vector<std::pair<int, int64_t>> slowest_rank_counts;  // rank -> used steps it was slowest
};

// Warm-up = the first `warmup` step positions of each run (position = step - first step).
// Steps with a missing rank are excluded (their maximum is unknown) and listed.
RunSummary summarize_series(const StepSeries& series, int64_t warmup, int64_t window);
std::vector<RunSummary> summarize(const std::vector<StepRecord>& records, int64_t warmup,
                                  int64_t window);

struct Comparison {
  RunSummary old_run, new_run;
  double mean_change = 0, median_change = 0;  // new / old - 1
  int64_t windows_compared = 0, windows_improved = 0;
  // Agreement over the step indices both runs logged (warm-up included: same seeds give
  // the same losses from the first step). nullopt when no common value exists.
  int64_t agreement_steps = 0;
  std::optional<double> loss_mae, loss_max_abs, grad_norm_mae, grad_norm_max_abs;
  bool all_finite = true;  // every loss and grad_norm of both runs is finite
};

// Both sides must hold exactly one run.
Comparison compare(const std::vector<StepRecord>& old_records,
                   const std::vector<StepRecord>& new_records, int64_t warmup, int64_t window);

// Readable tables (the training step prints `format_summary_table` at the end).
std::string format_summary_table(const std::vector<RunSummary>& summaries);
std::string format_comparison(const Comparison& comparison);

nlohmann::json to_json(const RunSummary& summary);
nlohmann::json summaries_to_json(const std::vector<RunSummary>& summaries);  // {"runs": [...]}
nlohmann::json to_json(const Comparison& comparison);

// ---------------------------------------------------------------- crossover plan

// Limits of a plan (plan_crossover and plan_from_json refuse more).
inline constexpr int kMaxPlanConditions = 64;
inline constexpr int kMaxPlanRuns = 10000;
inline constexpr int64_t kMaxPlanSteps = int64_t{1} << 40;  // block_steps, warmup
inline constexpr int kMaxPlanCycles = 1024;

struct PlannedRun {
  std::string name;                 // "run0", "run1", ...
  std::string allocation;
  std::vector<std::string> blocks;  // condition of each block position (conditions x cycles)
};

struct PlannedStep {
  std::string condition;
  int block = 0;         // warm-up steps belong to block 0 (they run its condition)
  bool warmup = false;
};

struct CrossoverPlan {
  std::vector<std::string> conditions;   // the first is the default baseline
  std::vector<std::string> allocations;  // "default" when none were given
  int64_t block_steps = 0;
  int64_t warmup = 0;
  int64_t exclude_after_transition = 0;  // recommended for the analysis
  int64_t cycles = 1;                    // times each run holds each condition
  std::string design;                    // "williams" or "cyclic latin square"
  bool carryover_balanced = false;       // each condition follows each other equally often
  std::vector<PlannedRun> runs;

  // warmup + block_steps x conditions x cycles; Error when it does not fit in int64.
  int64_t steps_per_run() const;
  // Condition and block of step position `position` (0-based) of run `run_index`.
  PlannedStep at(int run_index, int64_t position) const;
  int run_index(const std::string& run_name) const;  // -1 when absent
};

// Every run holds every condition `cycles` times as a block of `block_steps` steps (one
// square row per cycle); each condition is equally often at each block position on every
// allocation (so `runs` must be a multiple of conditions x allocations). Williams squares
// (first-order carryover balance) are used whenever the run count allows, else cyclic
// Latin squares; across cycles the rows are shifted so the transitions between cycles
// even out too. Short blocks in many cycles put the conditions compared close together
// in time, inside every run: the design that resolves small effects on a drifting
// machine (docs/stats.md). Throws when the request cannot be balanced.
CrossoverPlan plan_crossover(const std::vector<std::string>& conditions, int runs,
                             int64_t block_steps, int64_t warmup,
                             const std::vector<std::string>& allocations = {},
                             int64_t exclude_after_transition = 2, int cycles = 1);

nlohmann::json to_json(const CrossoverPlan& plan);
CrossoverPlan plan_from_json(const nlohmann::json& json, const std::string& name = "plan");
CrossoverPlan read_plan(const std::string& path);
void write_plan(const std::string& path, const CrossoverPlan& plan);
std::string format_plan(const CrossoverPlan& plan);

// Balance counts of a plan, for tests and the readable output:
// count[position][condition], per allocation, and ordered-succession counts.
struct PlanBalance {
  bool positions_balanced = false;    // per allocation and overall
  bool every_run_complete = false;    // each run holds each condition exactly once
  bool carryover_balanced = false;    // every ordered pair (a, b), a != b, adjacent equally often
};
PlanBalance check_balance(const CrossoverPlan& plan);

// ---------------------------------------------------------------- crossover analysis

struct CrossoverOptions {
  std::string baseline;                   // "" -> the plan's first condition, else the first seen
  std::optional<int64_t> warmup;          // default: the plan's, else 0
  std::optional<int64_t> exclude_after_transition;  // default: the plan's, else 2
  // Combined conditions for the interaction view: {combined, {first, second}}.
  // Conditions named "A+B" whose parts are conditions are added automatically.
  std::vector<std::pair<std::string, std::pair<std::string, std::string>>> interactions;
  const CrossoverPlan* plan = nullptr;    // optional: checks the logs, fills missing conditions
};

struct PairResult {
  std::string condition, versus;   // ratio = condition / versus
  double geomean_ratio = 1, reduction = 0, ci_low = 0, ci_high = 0;  // reduction = 1 - ratio
  int64_t matched_positions = 0;
  // The independent units the interval rests on: the runs that hold either side at a
  // matched position. Fewer than kMinIntervalRuns: no interval (ci_* are NaN).
  int64_t independent_runs = 0;
  double geomean_ratio_with_transitions = 1, reduction_with_transitions = 0;
  double ci_low_with_transitions = 0, ci_high_with_transitions = 0;
  int64_t matched_positions_with_transitions = 0;
  int64_t independent_runs_with_transitions = 0;
};

struct ConditionSummary {
  std::string condition;
  int64_t steps_used = 0;
  double mean_s = 0, median_s = 0;
};

// One other logged field (a phase's duration, say), reduced like the step: per condition
// the median of its used values, and each condition against the baseline.
struct FieldResult {
  std::string field;
  std::vector<ConditionSummary> conditions;
  std::vector<PairResult> comparisons;  // each condition vs the baseline
  // Used steps left out for this field: not logged by every rank, non-finite or <= 0.
  int64_t steps_skipped = 0;
};

struct Interaction {
  std::string combined, first, second;
  double combined_vs_baseline = 0, first_vs_baseline = 0, second_vs_baseline = 0;  // reductions
  double combined_vs_first = 0;    // gain of `second` on top of `first`
  double combined_vs_second = 0;   // gain of `first` on top of `second`
  double independent_prediction = 0;  // 1 - r_first * r_second
};

struct CrossoverResult {
  std::string baseline;
  int64_t warmup = 0, exclude_after_transition = 0;
  int num_runs = 0;
  std::vector<std::string> conditions;
  std::vector<ConditionSummary> condition_summaries;
  std::vector<PairResult> comparisons;  // each vs baseline first, then every other pair
  std::vector<Interaction> interactions;
  std::vector<FieldResult> fields;      // every other numeric field of the logs, by name
  std::vector<std::string> notes;       // missing ranks/steps, unmatched positions, ...
  std::vector<StepSeries> series;       // what was analysed (for plots)
};

CrossoverResult analyze_crossover(const std::vector<StepRecord>& records,
                                  const CrossoverOptions& options = {});
std::string format_crossover(const CrossoverResult& result);
nlohmann::json to_json(const CrossoverResult& result);

// The 95% interval of a paired reduction, from the runs' contributions to it.
//
// The estimate (the mean over matched positions of the difference of the two sides' mean
// log durations) is a sum over runs: each run contributes its log durations at the matched
// positions, weighted +1/(runs of the condition there) or -1/(runs of the other), divided
// by the number of positions. Where a run holds both sides equally often (every balanced
// plan) its weights sum to zero, so its speed offset cancels inside its own contribution.
// Runs are independent (a run's steps share its offset and its drift, so positions are
// not): the variance of the sum is estimated from the spread of the contributions
// (n/(n-1) sum (z - mean z)^2, cluster-robust) and the interval uses Student's t with
// n - 1 degrees of freedom. It covers the step-to-step noise, drift within runs and run
// offsets; it does not cover a drift every run shares that the plan does not balance.
inline constexpr int64_t kMinIntervalRuns = 3;
struct RunContrastCI {
  double log_ratio = 0;    // the sum of the contributions (NaN without any)
  double low = 0, high = 0;  // log-ratio bounds; NaN with fewer than kMinIntervalRuns runs
  int64_t runs = 0;
};
RunContrastCI run_contrast_ci(const std::vector<double>& run_contributions);
// Student's t 0.975 quantile for df >= 1 (a table to 30, then the Cornish-Fisher series).
double student_t_975(int64_t df);

// ---------------------------------------------------------------- plots

// SVG plots of step duration against step index, warm-up shaded, block boundaries marked.
void plot_summary(const std::string& svg_path, const std::vector<StepSeries>& series,
                  int64_t warmup);
void plot_comparison(const std::string& svg_path, const StepSeries& old_series,
                     const StepSeries& new_series, int64_t warmup);
void plot_crossover(const std::string& svg_path, const CrossoverResult& result);
// The paired reductions against the baseline with their intervals, one row per condition:
// the step first, then every other field (per-phase durations), grouped.
void plot_reductions(const std::string& svg_path, const CrossoverResult& result, const std::string& title);

}  // namespace leanstep::stats
