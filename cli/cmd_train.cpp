// `leanstep train`: the MoE-LoRA fine-tuning step, data parallel over MPI when
// launched by mpirun, with per-rank step logs, an optional counterbalanced
// crossover of dispatch presets, checkpoints and a step-time summary.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "leanstep/comm.h"
#include "leanstep/stats.h"
#include "leanstep/train.h"
#include "output.h"

namespace leanstep::cli {

namespace {

struct TrainOptions {
  std::string config;
  int64_t steps = -1;
  std::string preset = "all";
  std::string crossover;
  std::string log;
  std::string save;
  std::string resume;
  bool json = false;
  int64_t warmup = -1;  // default: the plan's, else min(20, steps / 5)
  int64_t window = 20;
  double timeout_s = 120.0;
};

// Launched by mpirun / srun with more than one process?
bool launched_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(var)) return true;
  return false;
}

// "steps.jsonl" -> "steps.rank1.jsonl" when there are several ranks.
std::string rank_log_path(const std::string& path, int rank, int world) {
  if (path.empty() || world == 1) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / fmt::format("{}.rank{}{}", p.stem().string(), rank, p.extension().string())).string();
}

struct Logged {
  train::StepRecord step;
  std::string run, condition, allocation;
  int block = -1;
};

void run_train(const TrainOptions& o) {
  const train::Config cfg = train::load_config(o.config);
  std::unique_ptr<comm::Communicator> world_comm;
  if (launched_under_mpi()) world_comm = comm::mpi_world(o.timeout_s);
  comm::Communicator* comm = world_comm.get();
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  const bool lead = rank == 0;

  std::optional<stats::CrossoverPlan> plan;
  if (!o.crossover.empty()) {
    plan = stats::read_plan(o.crossover);
    if (o.steps >= 0 && o.steps != plan->steps_per_run())
      throw_arg_error("train", "--steps",
                      fmt::format("must equal the plan's steps per run ({}) or be omitted (got {})",
                                  plan->steps_per_run(), o.steps));
  } else if (o.steps < 0) {
    throw_arg_error("train", "--steps", "is required without --crossover");
  }
  const int64_t steps_per_run = plan ? plan->steps_per_run() : o.steps;
  const int num_runs = plan ? static_cast<int>(plan->runs.size()) : 1;
  const int64_t warmup = o.warmup >= 0 ? o.warmup : plan ? plan->warmup : std::min<int64_t>(20, steps_per_run / 5);

  train::TrainerOptions topt;
  topt.comm = comm;
  topt.preset = plan ? plan->runs.at(0).blocks.at(0) : o.preset;
  auto trainer = std::make_unique<train::Trainer>(cfg, topt);
  if (!o.resume.empty()) trainer->load(o.resume);
  const int64_t start_step = trainer->next_step();

  // What makes runs comparable: print it before the first step.
  // Each rank's first microbatch of the first two steps.
  std::vector<int64_t> hashes(static_cast<size_t>(2 * world), 0);
  for (int m = 0; m < 2; ++m)
    hashes[static_cast<size_t>(2 * rank + m)] = static_cast<int64_t>(trainer->microbatch_hash(start_step + m, 0));
  if (comm) comm->allreduce(Tensor(hashes.data(), DType::kInt64, {2 * world}), comm::ReduceOp::kSum);
  if (lead) {
    const auto& m = cfg.model;
    std::fprintf(stderr,
                 "leanstep train: %s: hidden %lld, %lld layers, %lld/%lld heads, %lld experts top-%lld, LoRA rank %lld "
                 "alpha %g on %s\n",
                 o.config.c_str(), static_cast<long long>(m.hidden_size), static_cast<long long>(m.num_hidden_layers),
                 static_cast<long long>(m.num_attention_heads), static_cast<long long>(m.num_key_value_heads),
                 static_cast<long long>(m.num_experts), static_cast<long long>(m.num_experts_per_tok),
                 static_cast<long long>(cfg.lora.rank), cfg.lora.alpha, fmt::format("{}", fmt::join(cfg.lora.targets, ",")).c_str());
    std::fprintf(stderr,
                 "  %d rank(s) (%s), %zu trainable tensors, %lld params (fp32 flat buffer), microbatch %lld x %lld "
                 "tokens x %lld per rank\n",
                 world, comm ? comm->name().c_str() : "single process", trainer->trainable().size(),
                 static_cast<long long>(trainer->trainable_params()), static_cast<long long>(cfg.train.micro_batch_size),
                 static_cast<long long>(cfg.train.seq_len), static_cast<long long>(cfg.train.grad_accum_steps));
    std::string hs;
    for (int r = 0; r < world; ++r)
      hs += fmt::format("{}rank {}: {:016x} {:016x}", r ? ", " : "", r, static_cast<uint64_t>(hashes[static_cast<size_t>(2 * r)]),
                        static_cast<uint64_t>(hashes[static_cast<size_t>(2 * r + 1)]));
    std::fprintf(stderr, "  first microbatch hashes (steps %lld, %lld): %s\n", static_cast<long long>(start_step),
                 static_cast<long long>(start_step + 1), hs.c_str());
    if (plan)
      std::fprintf(stderr, "  crossover %s: %d runs x %lld steps (warm-up %lld, blocks of %lld)\n", o.crossover.c_str(),
                   num_runs, static_cast<long long>(steps_per_run), static_cast<long long>(plan->warmup),
                   static_cast<long long>(plan->block_steps));
  }

  std::unique_ptr<stats::StepLogWriter> writer;
  if (!o.log.empty()) {
    const std::string path = rank_log_path(o.log, rank, world);
    if (std::filesystem::path(path).has_parent_path()) std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    writer = std::make_unique<stats::StepLogWriter>(path);
  }

  std::vector<Logged> logged;
  // Progress on stderr (rank 0): rewritten in place on a terminal; otherwise
  // every 10th step, block starts and the last step of a run.
  const bool progress_on = lead && !o.json, progress_tty = isatty(2) != 0;
  const int64_t total_steps = steps_per_run * num_runs;
  int64_t done_steps = 0;
  for (int run = 0; run < num_runs; ++run) {
    // Every run of a crossover starts from the same state (same init or checkpoint).
    if (run > 0) {
      trainer = std::make_unique<train::Trainer>(cfg, topt);
      if (!o.resume.empty()) trainer->load(o.resume);
    }
    const std::string run_name = plan ? plan->runs[static_cast<size_t>(run)].name : o.preset;
    for (int64_t pos = 0; pos < steps_per_run; ++pos) {
      Logged l;
      l.run = run_name;
      if (plan) {
        const stats::PlannedStep ps = plan->at(run, pos);
        if (trainer->preset() != ps.condition) trainer->set_preset(ps.condition);
        l.condition = ps.condition;
        l.block = ps.block;
        l.allocation = plan->runs[static_cast<size_t>(run)].allocation;
      } else {
        l.condition = o.preset;
      }
      l.step = trainer->step();
      if (writer) {
        stats::StepRecord r;
        r.run = l.run;
        r.rank = rank;
        r.step = l.step.step;
        r.duration_s = l.step.duration_s;
        r.condition = l.condition;
        if (l.block >= 0) r.block = l.block;
        r.loss = l.step.loss;
        r.grad_norm = l.step.grad_norm;
        r.allocation = l.allocation;
        writer->write(r);
      }
      ++done_steps;
      const bool show = progress_tty || pos % 10 == 0 || pos + 1 == steps_per_run ||
                        (plan && pos > 0 && plan->at(run, pos - 1).condition != l.condition);
      if (progress_on && show) {
        const std::string line = fmt::format("[{}/{}] {}{} step {} loss {:.4f} grad_norm {:.4f}{} {:.1f} ms", done_steps,
                                             total_steps, plan ? run_name + " " : "", l.condition, l.step.step,
                                             l.step.loss, l.step.grad_norm,
                                             l.step.skipped ? " (skipped: found_inf)" : "", l.step.duration_s * 1e3);
        if (progress_tty) std::fprintf(stderr, "\r\033[K%s", line.c_str());
        else std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      }
      logged.push_back(std::move(l));
    }
  }
  if (progress_on && progress_tty) std::fprintf(stderr, "\r\033[K");
  if (!o.save.empty()) {
    trainer->save(o.save);
    if (lead) std::fprintf(stderr, "checkpoint written to %s/adapters.safetensors\n", o.save.c_str());
  }

  // Every rank's durations to rank 0 (the step duration is the max over ranks).
  const int64_t n = static_cast<int64_t>(logged.size());
  std::vector<double> durations(static_cast<size_t>(n * world), 0.0);
  for (int64_t i = 0; i < n; ++i) durations[static_cast<size_t>(rank * n + i)] = logged[static_cast<size_t>(i)].step.duration_s;
  if (comm) comm->allreduce(Tensor(durations.data(), DType::kFloat64, {n * world}), comm::ReduceOp::kSum);
  if (!lead) return;
  std::vector<stats::StepRecord> records;
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const Logged& l = logged[static_cast<size_t>(i)];
      stats::StepRecord s;
      s.run = l.run;
      s.rank = r;
      s.step = l.step.step;
      s.duration_s = durations[static_cast<size_t>(r * n + i)];
      s.condition = l.condition;
      if (l.block >= 0) s.block = l.block;
      s.loss = l.step.loss;
      s.grad_norm = l.step.grad_norm;
      s.allocation = l.allocation;
      records.push_back(std::move(s));
    }
  const auto summaries = stats::summarize(records, warmup, o.window);
  if (plan) {
    stats::CrossoverOptions co;
    co.plan = &*plan;
    const auto result = stats::analyze_crossover(records, co);
    if (o.json) {
      print_json_line({{"summary", stats::summaries_to_json(summaries)}, {"crossover", stats::to_json(result)}});
    } else {
      std::printf("%s\n", stats::format_summary_table(summaries).c_str());
      std::printf("Step durations measured on this machine's CPUs (%d rank(s)).\n", world);
      std::printf("%s", stats::format_crossover(result).c_str());
    }
  } else if (o.json) {
    print_json_line(stats::summaries_to_json(summaries));
  } else {
    std::printf("%s", stats::format_summary_table(summaries).c_str());
    const auto& last = logged.back().step;
    std::printf("final step %lld: loss %.4f, grad_norm %.4f (first step loss %.4f)\n", static_cast<long long>(last.step),
                last.loss, last.grad_norm, logged.front().step.loss);
  }
}

}  // namespace

void add_train_commands(Context& ctx) {
  auto o = std::make_shared<TrainOptions>();
  auto* cmd = ctx.root.add_subcommand(
      "train",
      "MoE-LoRA fine-tuning step on CPU (data parallel over MPI under mpirun): progress, per-rank step logs, "
      "summary; --crossover runs a counterbalanced comparison of dispatch presets");
  cmd->add_option("--config", o->config, "Model + LoRA + training config (e.g. examples/tiny-moe/tiny.json)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--steps", o->steps, "Optimizer steps (per run with --crossover: must match the plan)");
  cmd->add_option("--preset", o->preset,
                  "Dispatch preset: baseline, all, or op groups joined by ',' or '+' (e.g. rmsnorm+grad)")
      ->default_str("all");
  cmd->add_option("--crossover", o->crossover,
                  "Crossover plan (JSON from `leanstep crossover plan --json`): every run, each condition a block")
      ->check(CLI::ExistingFile);
  cmd->add_option("--log", o->log, "Step log (JSON Lines); with several ranks one file per rank: NAME.rankN.EXT");
  cmd->add_option("--save", o->save, "Write a checkpoint (adapters + optimizer state, safetensors) to DIR at the end");
  cmd->add_option("--resume", o->resume, "Start from the checkpoint in DIR (every crossover run starts from it)");
  cmd->add_option("--warmup", o->warmup, "Steps excluded from the summary (default: the plan's, else min(20, steps/5))");
  cmd->add_option("--window", o->window, "Window of the summary's window means")->default_val(20);
  cmd->add_option("--timeout", o->timeout_s, "Seconds a collective may wait for the other ranks before failing")
      ->default_val(120.0);
  cmd->add_flag("--json", o->json, "Print the summary (and crossover analysis) as one JSON object");
  cmd->callback([o] { run_train(*o); });
}

}  // namespace leanstep::cli
