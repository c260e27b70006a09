// `leanstep train`: the MoE-LoRA fine-tuning step, data parallel over MPI when
// launched by mpirun, with per-rank step logs, an optional counterbalanced
// crossover of dispatch presets, checkpoints and a step-time summary.
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
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
  bool overwrite = false;
  bool json = false;
  int64_t warmup = -1;  // default: the plan's, else min(20, steps / 5)
  int64_t window = 20;
  double timeout_s = 120.0;
  // Which options were given (a value such as -1 is then an error, not "default").
  CLI::Option* steps_opt = nullptr;
  CLI::Option* warmup_opt = nullptr;
};

// Largest --steps / --warmup accepted (the step index must stay far from int64 overflow).
constexpr int64_t kMaxSteps = int64_t{1} << 40;

// Checks of the options alone, before MPI, the config or any step.
void check_options(const TrainOptions& o) {
  if (o.steps_opt->count() > 0 && (o.steps < 1 || o.steps > kMaxSteps))
    throw_arg_error("train", "--steps", fmt::format("must be in [1, 2^40] (got {})", o.steps));
  if (o.steps_opt->count() == 0 && o.crossover.empty())
    throw_arg_error("train", "--steps", "is required without --crossover");
  if (o.warmup_opt->count() > 0 && (o.warmup < 0 || o.warmup > kMaxSteps))
    throw_arg_error("train", "--warmup", fmt::format("must be in [0, 2^40] (got {})", o.warmup));
  if (o.window < 1 || o.window > kMaxSteps)
    throw_arg_error("train", "--window", fmt::format("must be in [1, 2^40] (got {})", o.window));
  if (!(std::isfinite(o.timeout_s) && o.timeout_s > 0))
    throw_arg_error("train", "--timeout", fmt::format("must be a finite number of seconds > 0 (got {})", o.timeout_s));
  if (!o.resume.empty()) {
    const std::filesystem::path ck = std::filesystem::path(o.resume) / "adapters.safetensors";
    if (!std::filesystem::is_directory(o.resume))
      throw_arg_error("train", "--resume", fmt::format("must name a checkpoint directory (got '{}', {})", o.resume,
                                                       std::filesystem::exists(o.resume) ? "not a directory"
                                                                                         : "which does not exist"));
    if (!std::filesystem::is_regular_file(ck))
      throw_arg_error("train", "--resume",
                      fmt::format("must name a directory holding adapters.safetensors (got '{}')", o.resume));
  }
  if (!o.save.empty()) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::file_status st = fs::status(o.save, ec);
    if (fs::exists(st) && !fs::is_directory(st))
      throw_arg_error("train", "--save", fmt::format("must name a directory (got '{}', which is not a directory)", o.save));
    if (fs::is_directory(st) && fs::exists(fs::path(o.save) / "adapters.safetensors") && !o.overwrite)
      throw_arg_error("train", "--save",
                      fmt::format("names a directory that already holds a checkpoint (got '{}'; pass --overwrite to "
                                  "replace it)",
                                  o.save));
    // An existing ancestor that is a file makes the directory impossible.
    for (fs::path p = fs::path(o.save).parent_path(); !p.empty(); p = p.parent_path()) {
      if (fs::exists(p, ec) && !fs::is_directory(p, ec))
        throw_arg_error("train", "--save",
                        fmt::format("cannot be created: '{}' is not a directory (got '{}')", p.string(), o.save));
      if (p == p.parent_path()) break;
    }
  }
}

// Creates the --save directory and proves it writable (rank 0), before any step.
// Returns "" or the reason it is not usable.
std::string prepare_save_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot be created (got '{}': {})", dir, ec.message());
  const fs::path probe = fs::path(dir) / fmt::format(".leanstep-write-test.{}", ::getpid());
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) return fmt::format("must name a writable directory (got '{}': {})", dir, std::strerror(errno));
  std::fclose(f);
  fs::remove(probe, ec);
  return "";
}

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


void run_train(const TrainOptions& o) {
  check_options(o);
  const train::Config cfg = train::load_config(o.config);

  std::optional<stats::CrossoverPlan> plan;
  if (!o.crossover.empty()) {
    plan = stats::read_plan(o.crossover);
    if (o.steps_opt->count() > 0 && o.steps != plan->steps_per_run())
      throw_arg_error("train", "--steps",
                      fmt::format("must equal the plan's steps per run ({}) or be omitted (got {})",
                                  plan->steps_per_run(), o.steps));
    if (plan->steps_per_run() > kMaxSteps)
      throw_arg_error("train", "--crossover", fmt::format("plan must have at most 2^40 steps per run (got {})",
                                                          plan->steps_per_run()));
  }
  const int64_t steps_per_run = plan ? plan->steps_per_run() : o.steps;
  const int num_runs = plan ? static_cast<int>(plan->runs.size()) : 1;
  const int64_t warmup = o.warmup_opt->count() > 0 ? o.warmup : plan ? plan->warmup : std::min<int64_t>(20, steps_per_run / 5);
  // The summary needs at least one step after the warm-up: say so now, not after training.
  if (warmup >= steps_per_run)
    throw_arg_error("train", "--warmup",
                    fmt::format("must be less than the steps per run ({}) so that the summary has steps (got {})",
                                steps_per_run, warmup));

  std::unique_ptr<comm::Communicator> world_comm;
  if (launched_under_mpi()) world_comm = comm::mpi_world(o.timeout_s);
  comm::Communicator* comm = world_comm.get();
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  const bool lead = rank == 0;

  // The checkpoint directory is created and proven writable before any step.
  if (!o.save.empty()) {
    const std::string why = lead ? prepare_save_dir(o.save) : "";
    float failed = why.empty() ? 0.0f : 1.0f;
    if (comm) comm->allreduce(Tensor(&failed, DType::kFloat32, {1}), comm::ReduceOp::kMax);
    if (failed != 0.0f)
      throw_arg_error("train", "--save", why.empty() ? fmt::format("is not usable on rank 0 (got '{}')", o.save) : why);
  }

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

  // Progress on stderr (rank 0): rewritten in place on a terminal; otherwise
  // every 10th step, block starts and the last step of a run.
  const bool progress_on = lead && !o.json, progress_tty = isatty(2) != 0;
  train::RunOptions ro;
  ro.plan = plan ? &*plan : nullptr;
  ro.steps = steps_per_run;
  ro.preset = o.preset;
  ro.log = writer.get();
  ro.on_step = [&](const train::RunStep& s) {
    const bool show = progress_tty || s.position % 10 == 0 || s.position + 1 == s.steps_per_run || s.condition_changed;
    if (!progress_on || !show) return;
    const std::string line = fmt::format("[{}/{}] {}{} step {} loss {:.4f} grad_norm {:.4f}{} {:.1f} ms", s.done,
                                         s.total, plan ? s.run + " " : "", s.condition, s.step.step, s.step.loss,
                                         s.step.grad_norm, s.step.skipped ? " (skipped: found_inf)" : "",
                                         s.step.duration_s * 1e3);
    if (progress_tty) std::fprintf(stderr, "\r\033[K%s", line.c_str());
    else std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  };
  auto make_trainer = [&] {
    auto t = std::make_unique<train::Trainer>(cfg, topt);
    if (!o.resume.empty()) t->load(o.resume);
    return t;
  };
  train::RunResult run = train::run_crossover(make_trainer, ro, comm, std::move(trainer));
  if (progress_on && progress_tty) std::fprintf(stderr, "\r\033[K");
  if (!o.save.empty()) {
    run.trainer->save(o.save);
    if (lead) std::fprintf(stderr, "checkpoint written to %s/adapters.safetensors\n", o.save.c_str());
  }
  if (!lead) return;
  const std::vector<stats::StepRecord>& records = run.records;
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
    if (!records.empty()) {
      const auto& last = run.last;
      std::printf("final step %lld: loss %.4f, grad_norm %.4f (first step loss %.4f)\n",
                  static_cast<long long>(last.step), last.loss, last.grad_norm, run.first.loss);
    }
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
  o->steps_opt = cmd->add_option("--steps", o->steps, "Optimizer steps, >= 1 (per run with --crossover: must match the plan)");
  cmd->add_option("--preset", o->preset,
                  "Dispatch preset: baseline, all, or op groups joined by ',' or '+' (e.g. rmsnorm+grad)")
      ->default_str("all");
  cmd->add_option("--crossover", o->crossover,
                  "Crossover plan (JSON from `leanstep crossover plan --json`): every run, each condition a block")
      ->check(CLI::ExistingFile);
  cmd->add_option("--log", o->log, "Step log (JSON Lines); with several ranks one file per rank: NAME.rankN.EXT");
  cmd->add_option("--save", o->save,
                  "Write a checkpoint (adapters + optimizer state, safetensors) to DIR at the end (checked before "
                  "the first step)");
  cmd->add_flag("--overwrite", o->overwrite, "Replace a checkpoint that --save DIR already holds");
  cmd->add_option("--resume", o->resume, "Start from the checkpoint in DIR (every crossover run starts from it)");
  o->warmup_opt = cmd->add_option("--warmup", o->warmup,
                                  "Steps excluded from the summary, >= 0 and < steps (default: the plan's, else "
                                  "min(20, steps/5))");
  cmd->add_option("--window", o->window, "Window of the summary's window means")->default_val(20);
  cmd->add_option("--timeout", o->timeout_s, "Seconds a collective may wait for the other ranks before failing")
      ->default_val(120.0);
  cmd->add_flag("--json", o->json, "Print the summary (and crossover analysis) as one JSON object");
  cmd->callback([o] { run_train(*o); });
}

}  // namespace leanstep::cli
