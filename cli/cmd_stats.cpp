// `leanstep steps summarize|compare` and `leanstep crossover plan|analyze`.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "commands.h"
#include "leanstep/core.h"
#include "leanstep/stats.h"
#include "output.h"

namespace leanstep::cli {

namespace {

namespace st = leanstep::stats;

struct StepsOptions {
  std::vector<std::string> logs;
  std::string old_log, new_log;
  int64_t warmup = 20;
  int64_t window = 20;
  bool json = false;
  std::string plot;
};

struct PlanOptions {
  std::vector<std::string> conditions, allocations;
  int runs = 0;
  int64_t block_steps = 0;
  int64_t warmup = 20;
  int64_t exclude_after_transition = 2;
  int cycles = 1;
  bool json = false;
  std::string out;
};

struct AnalyzeOptions {
  std::vector<std::string> logs;
  std::string plan;
  int64_t warmup = -1;
  int64_t exclude_after_transition = -1;
  std::string baseline;
  bool json = false;
  std::string plot;
  std::string reductions_plot;
  std::vector<std::string> interactions;
};

void warn_missing(const std::vector<st::RunSummary>& summaries) {
  for (const auto& r : summaries) {
    if (!r.missing_steps.empty())
      std::fprintf(stderr, "leanstep: warning: run '%s': %zu step(s) logged by no rank\n", r.run.c_str(),
                   static_cast<size_t>(r.missing_step_count));
    if (!r.incomplete.empty())
      std::fprintf(stderr, "leanstep: warning: run '%s': %zu step(s) with missing ranks excluded\n", r.run.c_str(),
                   r.incomplete.size());
  }
}

// The positions a series spans (last logged step - first + 1).
int64_t span_of(const st::StepSeries& s) { return s.steps.empty() ? 0 : s.steps.back() - s.first_step + 1; }

// A warm-up that leaves no step is an error, not an empty table with exit 0.
void check_steps_left(const char* cmd, const std::vector<st::RunSummary>& summaries, int64_t warmup,
                      const std::vector<const st::StepSeries*>& series, bool every_run) {
  for (size_t i = 0; i < summaries.size(); ++i) {
    const bool empty = summaries[i].steps_used == 0;
    if (empty && (every_run || std::all_of(summaries.begin(), summaries.end(), [](auto& r) { return r.steps_used == 0; }))) {
      const int64_t span = span_of(*series[i]);
      if (warmup >= span)
        throw_arg_error(cmd, "--warmup",
                        fmt::format("must be less than the {} step position(s) of run '{}' so that steps are left "
                                    "(got {})",
                                    span, summaries[i].run, warmup));
      throw Error(fmt::format("{}: run '{}' has no complete step after the warm-up of {} (every step misses a rank)",
                              cmd, summaries[i].run, warmup));
    }
  }
}

void run_summarize(const StepsOptions& o) {
  const auto records = st::read_step_logs(o.logs);
  const auto series = st::build_series(records);
  std::vector<st::RunSummary> summaries;
  for (const auto& s : series) summaries.push_back(st::summarize_series(s, o.warmup, o.window));
  std::vector<const st::StepSeries*> ptrs;
  for (const auto& s : series) ptrs.push_back(&s);
  check_steps_left("steps summarize", summaries, o.warmup, ptrs, false);
  if (!o.plot.empty()) st::plot_summary(o.plot, series, o.warmup);
  if (o.json) {
    warn_missing(summaries);
    print_json_line(st::summaries_to_json(summaries));
  } else {
    std::fputs(st::format_summary_table(summaries).c_str(), stdout);
    if (!o.plot.empty()) std::printf("plot: %s\n", o.plot.c_str());
  }
}

void run_compare(const StepsOptions& o) {
  const auto old_records = st::read_step_logs({o.old_log});
  const auto new_records = st::read_step_logs({o.new_log});
  const auto c = st::compare(old_records, new_records, o.warmup, o.window);
  const auto old_series = st::build_series(old_records), new_series = st::build_series(new_records);
  check_steps_left("steps compare", {c.old_run, c.new_run}, o.warmup, {&old_series.at(0), &new_series.at(0)}, true);
  if (!o.plot.empty()) st::plot_comparison(o.plot, old_series.at(0), new_series.at(0), o.warmup);
  if (o.json) {
    warn_missing({c.old_run, c.new_run});
    print_json_line(st::to_json(c));
  } else {
    std::fputs(st::format_comparison(c).c_str(), stdout);
    if (!o.plot.empty()) std::printf("plot: %s\n", o.plot.c_str());
  }
}

void run_plan(const PlanOptions& o) {
  const auto plan = st::plan_crossover(o.conditions, o.runs, o.block_steps, o.warmup, o.allocations,
                                       o.exclude_after_transition, o.cycles);
  if (!o.out.empty()) st::write_plan(o.out, plan);
  if (o.json) {
    print_json_line(st::to_json(plan));
  } else {
    std::fputs(st::format_plan(plan).c_str(), stdout);
    if (!o.out.empty()) std::printf("plan written to %s (pass it to `crossover analyze --plan`)\n", o.out.c_str());
  }
}

void run_analyze(const AnalyzeOptions& o) {
  st::CrossoverOptions options;
  std::unique_ptr<st::CrossoverPlan> plan;
  if (!o.plan.empty()) {
    plan = std::make_unique<st::CrossoverPlan>(st::read_plan(o.plan));
    options.plan = plan.get();
  }
  if (o.warmup >= 0) options.warmup = o.warmup;
  if (o.exclude_after_transition >= 0) options.exclude_after_transition = o.exclude_after_transition;
  options.baseline = o.baseline;
  for (const auto& spec : o.interactions) {
    // NAME=FIRST+SECOND (also accepts FIRST,SECOND after '=')
    const size_t eq = spec.find('=');
    const std::string parts = eq == std::string::npos ? "" : spec.substr(eq + 1);
    const size_t sep = parts.find_first_of("+:");
    if (eq == std::string::npos || sep == std::string::npos)
      throw_arg_error("crossover analyze", "--interaction",
                      fmt::format("must look like COMBINED=FIRST+SECOND (got '{}')", spec));
    options.interactions.push_back({spec.substr(0, eq), {parts.substr(0, sep), parts.substr(sep + 1)}});
  }
  const auto result = st::analyze_crossover(st::read_step_logs(o.logs), options);
  int64_t longest = 0;
  for (const auto& s : result.series) longest = std::max(longest, span_of(s));
  if (result.warmup >= longest)
    throw_arg_error("crossover analyze", "--warmup",
                    fmt::format("must be less than the longest run's {} step position(s) so that steps are left (got "
                                "{}{})",
                                longest, result.warmup, o.warmup >= 0 ? "" : ", the plan's"));
  if (std::all_of(result.comparisons.begin(), result.comparisons.end(),
                  [](const st::PairResult& p) { return p.matched_positions_with_transitions == 0; }))
    throw Error(fmt::format("crossover analyze: no two conditions share a step position after the warm-up of {}: "
                            "nothing to compare (runs must hold different conditions at the same positions)",
                            result.warmup));
  if (!o.plot.empty()) st::plot_crossover(o.plot, result);
  if (!o.reductions_plot.empty())
    st::plot_reductions(o.reductions_plot, result, "leanstep crossover analyze: reductions vs the baseline");
  if (o.json) {
    for (const auto& n : result.notes) std::fprintf(stderr, "leanstep: note: %s\n", n.c_str());
    print_json_line(st::to_json(result));
  } else {
    std::fputs(st::format_crossover(result).c_str(), stdout);
    if (!o.plot.empty()) std::printf("plot: %s\n", o.plot.c_str());
    if (!o.reductions_plot.empty()) std::printf("plot: %s\n", o.reductions_plot.c_str());
  }
}

}  // namespace

void add_stats_commands(Context& ctx) {
  auto* steps = ctx.root.add_subcommand("steps", "Step-time statistics from per-rank step logs (JSON Lines or CSV)");
  steps->require_subcommand(1);

  auto summarize_opts = std::make_shared<StepsOptions>();
  auto* summarize = steps->add_subcommand(
      "summarize", "Per run: step duration = max over ranks; after warm-up: count, mean, median, min, max, window means");
  summarize->add_option("logs", summarize_opts->logs, "Step logs (.jsonl / .csv files or directories)")->required();
  summarize->add_option("--warmup", summarize_opts->warmup, "Steps discarded at the start of each run")
      ->capture_default_str()->check(integer_in(0, st::kMaxStep, "2^62"));
  summarize->add_option("--window", summarize_opts->window, "Steps per window mean")
      ->capture_default_str()->check(integer_in(1, st::kMaxStep, "2^62"));
  summarize->add_flag("--json", summarize_opts->json, "One JSON object: {runs: [{run, steps_used, mean_s, median_s, windows, ...}]}");
  summarize->add_option("--plot", summarize_opts->plot, "Write an SVG plot of step duration against step index");
  summarize->callback([summarize_opts] { run_summarize(*summarize_opts); });

  auto compare_opts = std::make_shared<StepsOptions>();
  auto* compare = steps->add_subcommand(
      "compare", "Before/after: means, medians, relative change, windows improved, loss / grad_norm agreement");
  compare->add_option("old", compare_opts->old_log, "Step log(s) of the old run (file or directory)")->required();
  compare->add_option("new", compare_opts->new_log, "Step log(s) of the new run (file or directory)")->required();
  compare->add_option("--warmup", compare_opts->warmup, "Steps discarded at the start of each run")
      ->capture_default_str()->check(integer_in(0, st::kMaxStep, "2^62"));
  compare->add_option("--window", compare_opts->window, "Steps per window mean")
      ->capture_default_str()->check(integer_in(1, st::kMaxStep, "2^62"));
  compare->add_flag("--json", compare_opts->json, "One JSON object with old, new, mean_change, median_change, ...");
  compare->add_option("--plot", compare_opts->plot, "Write an SVG plot of both runs");
  compare->callback([compare_opts] { run_compare(*compare_opts); });

  auto* crossover = ctx.root.add_subcommand("crossover", "Counterbalanced crossover: Latin-square plans and paired analysis");
  crossover->require_subcommand(1);

  auto plan_opts = std::make_shared<PlanOptions>();
  auto* plan = crossover->add_subcommand(
      "plan", "A schedule: every run holds every condition once per cycle as a block, balanced over block positions "
              "and allocations");
  plan->add_option("--conditions", plan_opts->conditions, "Conditions, baseline first (e.g. baseline,A,B,A+B)")
      ->required()->delimiter(',');
  plan->add_option("--runs", plan_opts->runs, "Number of runs (a multiple of conditions x allocations)")
      ->required()
      ->check(integer_in(1, st::kMaxPlanRuns));
  plan->add_option("--block-steps", plan_opts->block_steps, "Steps per block")
      ->required()
      ->check(integer_in(1, st::kMaxPlanSteps, "2^40"));
  plan->add_option("--warmup", plan_opts->warmup, "Warm-up steps before the first block (run its condition)")
      ->capture_default_str()
      ->check(integer_in(0, st::kMaxPlanSteps, "2^40"));
  plan->add_option("--allocations", plan_opts->allocations, "Device allocations the runs are spread over")->delimiter(',');
  plan->add_option("--exclude-after-transition", plan_opts->exclude_after_transition,
                   "Steps after each block transition the analysis excludes")
      ->capture_default_str()
      ->check(integer_in(0, st::kMaxPlanSteps, "2^40"));
  plan->add_option("--cycles", plan_opts->cycles,
                   "Times each run holds each condition (short blocks in many cycles put the conditions compared "
                   "close together in time)")
      ->capture_default_str()
      ->check(integer_in(1, st::kMaxPlanCycles));
  plan->add_option("--out", plan_opts->out, "Also write the plan as JSON to this file");
  plan->add_flag("--json", plan_opts->json, "Print the plan as one JSON object");
  plan->callback([plan_opts] { run_plan(*plan_opts); });

  auto analyze_opts = std::make_shared<AnalyzeOptions>();
  auto* analyze = crossover->add_subcommand(
      "analyze", "Paired same-position step-duration ratios: geometric mean, reduction, 95% CI over runs, interactions");
  analyze->add_option("logs", analyze_opts->logs, "Step logs of all runs (.jsonl / .csv files or directories)")->required();
  analyze->add_option("--plan", analyze_opts->plan, "The plan JSON (checks the logs, supplies unlogged conditions)");
  analyze->add_option("--warmup", analyze_opts->warmup, "Warm-up steps discarded per run (default: the plan's, else 0)")
      ->check(integer_in(0, st::kMaxStep, "2^62"));
  analyze->add_option("--exclude-after-transition", analyze_opts->exclude_after_transition,
                      "Steps excluded after each block transition (default: the plan's, else 2)")
      ->check(integer_in(0, st::kMaxStep, "2^62"));
  analyze->add_option("--baseline", analyze_opts->baseline, "Baseline condition (default: the plan's first, else the first logged)");
  analyze->add_option("--interaction", analyze_opts->interactions,
                      "Combined condition and its parts, COMBINED=FIRST+SECOND (repeatable; names 'A+B' are found automatically)");
  analyze->add_flag("--json", analyze_opts->json, "One JSON object: {baseline, comparisons: [...], interactions, ...}");
  analyze->add_option("--plot", analyze_opts->plot, "Write an SVG plot: one panel per run, coloured by condition");
  analyze->add_option("--reductions-plot", analyze_opts->reductions_plot,
                      "Write an SVG chart of the reductions vs the baseline with their intervals (the step, then "
                      "every other logged field)");
  analyze->callback([analyze_opts] { run_analyze(*analyze_opts); });
}

}  // namespace leanstep::cli
