// The `leanstep` command: subcommands per area, `--json` output for machines.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "commands.h"
#include "leanstep/core.h"

int main(int argc, char** argv) {
  CLI::App app{"leanstep: fast, exact optimizer-step, RMSNorm and MoE paths for training"};
  app.set_version_flag("--version", std::string("leanstep ") + leanstep::kVersion);
  app.require_subcommand(1);
  auto* bench = app.add_subcommand("bench", "Benchmarks against the reference path and the memory-bandwidth floor");
  bench->require_subcommand(1);
  leanstep::cli::Context ctx{app, *bench};
  leanstep::cli::add_grad_commands(ctx);
  leanstep::cli::add_rmsnorm_commands(ctx);
  leanstep::cli::add_moe_commands(ctx);
  leanstep::cli::add_dispatch_commands(ctx);
  leanstep::cli::add_lora_commands(ctx);
  leanstep::cli::add_stats_commands(ctx);
  leanstep::cli::add_train_commands(ctx);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Usage errors exit 2 like every other error the user can fix; a RuntimeError
    // carries its own code (lora diff: 1 = the plans differ); --help exits 0.
    const int code = app.exit(e);
    if (code == 0 || dynamic_cast<const CLI::RuntimeError*>(&e)) return code;
    return 2;
  } catch (const leanstep::Error& e) {
    std::fprintf(stderr, "leanstep: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leanstep: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
