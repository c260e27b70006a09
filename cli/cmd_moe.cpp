// `leanstep` subcommands of the moe area.
#include "commands.h"

namespace leanstep::cli {

void add_moe_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
