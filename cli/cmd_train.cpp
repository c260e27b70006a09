// `leanstep` subcommands of the train area.
#include "commands.h"

namespace leanstep::cli {

void add_train_commands(Context& ctx) { (void)ctx; }

}  // namespace leanstep::cli
