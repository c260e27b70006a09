// The dispatch registry: one preset switch and one report for C++, the CLI,
// Python and the Megatron patches (the Python entry points call through it).
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <leanstep/dispatch.h>
#include <leanstep/ops.h>

#include "bindings.h"

namespace leanstep::py {

void bind_dispatch(nb::module_& m) {
  m.def(
      "dispatch_set_preset",
      [](const std::string& preset) { dispatch::registry().set_preset(preset); },
      nb::arg("preset"),
      "\"baseline\", \"all\", or a comma-separated list of op names / groups; an unknown name "
      "raises and changes nothing.");
  m.def("dispatch_preset", [] { return dispatch::registry().preset(); });
  m.def(
      "dispatch_op_table",
      [] {
        nb::list rows;
        for (const ops::OpEntry& entry : ops::op_table())
          rows.append(nb::make_tuple(entry.name, entry.device_backends));
        return rows;
      },
      "The op table (leanstep/ops.h): (name, comma-separated device backends) per row, in order.");
  m.def("dispatch_paths_json", [] { return dispatch::paths_json(); },
        "The `leanstep paths --json` report of the process-wide registry.");
  m.def("dispatch_paths_text", [] { return dispatch::paths_text(); });
  m.def("dispatch_reset_stats", [] { dispatch::registry().reset_stats(); });
}

}  // namespace leanstep::py
