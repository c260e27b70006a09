// `leanstep` subcommands of the grad area.
#include "commands.h"

namespace leanstep::cli {

void add_grad_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
