// Each area adds its subcommands to the `leanstep` command here.
#pragma once

#include <CLI/CLI.hpp>

namespace leanstep::cli {

struct Context {
  CLI::App& root;
  CLI::App& bench;  // `leanstep bench <area>`
};

void add_grad_commands(Context& ctx);      // bench grad, demo (until the training step)
void add_rmsnorm_commands(Context& ctx);   // bench rmsnorm
void add_moe_commands(Context& ctx);       // bench moe
void add_dispatch_commands(Context& ctx);  // paths
void add_lora_commands(Context& ctx);      // lora plan, lora diff
void add_stats_commands(Context& ctx);     // steps, crossover
void add_train_commands(Context& ctx);     // train

}  // namespace leanstep::cli
