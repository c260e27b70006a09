// `leanstep` subcommands of the lora area.
#include "commands.h"

namespace leanstep::cli {

void add_lora_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
