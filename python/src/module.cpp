// The extension module leanstep._leanstep: the core (errors, views, counters,
// threads) and every area compiled into this build. The user-facing API with
// output allocation in the caller's framework is in python/leanstep/.
#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <leanstep/core.h>

#include "core/bench.h"

#include "arrays.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace leanstep;
using namespace leanstep::py;

NB_MODULE(_leanstep, m) {
  m.doc() = "leanstep C++ library bindings (use the `leanstep` package)";
  m.attr("__version__") = kVersion;

  // leanstep::Error -> leanstep.Error (a ValueError), same message.
  nb::exception<Error>(m, "Error", PyExc_ValueError);

  m.def("num_threads", &num_threads, "Worker threads of parallel loops (results never depend on it).");
  m.def("set_num_threads", &set_num_threads, nb::arg("n"));

  m.def(
      "counters",
      [] {
        const Counters c = counters();
        nb::dict d;
        d["dispatches"] = c.dispatches;
        d["host_reads"] = c.host_reads;
        return d;
      },
      "Counters: parallel regions dispatched and host reads of backend scalars.");
  m.def("reset_counters", &reset_counters);

  // Introspection of what the library sees for an array: used to prove zero copy.
  m.def(
      "describe",
      [](InArray a) { return to_tensor(a, "array").describe(); }, nb::arg("array"),
      "The library's view of an array, e.g. 'bfloat16[4096, 2048] cpu'.");
  m.def(
      "data_ptr", [](InArray a) { return reinterpret_cast<uintptr_t>(to_tensor(a, "array").data); },
      nb::arg("array"), "Address of the first element as the library sees it.");
  m.def(
      "read_scalar", [](InArray a) { return read_scalar(to_tensor(a, "scalar")); },
      nb::arg("scalar"), "Reads a 1-element backend scalar on the host (counted as a host read).");

  // The machine's bandwidth for an access pattern ("read", "inplace", "copy"),
  // all threads, as the C++ benchmarks measure their floor.
  m.def(
      "measure_bandwidth",
      [](const std::string& access, size_t buffer_bytes) {
        bench::Access a;
        if (access == "read") a = bench::Access::kRead;
        else if (access == "inplace") a = bench::Access::kInPlace;
        else if (access == "copy") a = bench::Access::kCopy;
        else throw_arg_error("measure_bandwidth", "access",
                             "must be 'read', 'inplace' or 'copy' (got '" + access + "')");
        bench::Bandwidth bw;
        {
          nb::gil_scoped_release release;
          bw = bench::measure_bandwidth(a, buffer_bytes);
        }
        nb::dict d;
        d["access"] = access;
        d["gbps"] = bw.gbps();
        d["median_ms"] = bw.timing.median_ms;
        d["bytes_moved"] = bw.bytes_moved;
        d["buffer_bytes"] = bw.buffer_bytes;
        return d;
      },
      nb::arg("access"), nb::arg("buffer_bytes") = size_t{256} << 20);

  nb::list areas;
#ifdef LEANSTEP_BIND_COMM
  bind_comm(m);
  areas.append("comm");
#endif
#ifdef LEANSTEP_BIND_GRAD
  bind_grad(m);
  areas.append("grad");
#endif
#ifdef LEANSTEP_BIND_RMSNORM
  bind_rmsnorm(m);
  areas.append("rmsnorm");
#endif
#ifdef LEANSTEP_BIND_MOE
  bind_moe(m);
  areas.append("moe");
#endif
#ifdef LEANSTEP_BIND_LORA
  bind_lora(m);
  areas.append("lora");
#endif
#ifdef LEANSTEP_BIND_STATS
  bind_stats(m);
  areas.append("stats");
#endif
#ifdef LEANSTEP_BIND_DISPATCH
  bind_dispatch(m);
  areas.append("dispatch");
#endif
#ifdef LEANSTEP_BIND_TRAIN
  bind_train(m);
  areas.append("train");
#endif
  m.attr("areas") = areas;
}
