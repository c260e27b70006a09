// `leanstep` subcommands of the dispatch area.
#include "commands.h"

namespace leanstep::cli {

void add_dispatch_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
