// `leanstep` subcommands of the stats area.
#include "commands.h"

namespace leanstep::cli {

void add_stats_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
