// The extension module leanstep._leanstep: the core (errors, views, counters,
// threads) and every area compiled into this build. The user-facing API with
// output allocation in the caller's framework is in python/leanstep/.
#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <leanstep/core.h>
#include <leanstep/host_memory.h>

#include "leanstep/bench.h"

#include "arrays.h"
#include "bindings.h"
#include "exchange.h"

namespace nb = nanobind;
using namespace leanstep;
using namespace leanstep::py;

namespace {

nb::dlpack::dtype dlpack_dtype(const std::string& name) {
  const DType dtype = dtype_from_name(name);
  const auto bits = static_cast<uint8_t>(dtype_size(dtype) * 8);
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kFloat64:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), bits, 1};
    case DType::kBFloat16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), bits, 1};
    case DType::kUInt8:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::UInt), bits, 1};
    case DType::kBool:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bool), bits, 1};
    default:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Int), bits, 1};
  }
}

// An uninitialised C-contiguous array over a pool block, in torch or NumPy;
// the block goes back to the pool when the array's memory is released (the
// DLPack owner's destructor). None when the pool has no block for it.
nb::object pool_array(const std::vector<int64_t>& shape, const std::string& dtype, bool torch) {
  std::vector<size_t> sizes;
  size_t bytes = dtype_size(dtype_from_name(dtype));
  for (int64_t s : shape) {
    if (s < 0) throw_arg_error("pool_array", "shape", "must have non-negative sizes");
    sizes.push_back(static_cast<size_t>(s));
    bytes *= static_cast<size_t>(s);
  }
  void* block = host_pool_take(bytes);
  if (!block) return nb::none();
  nb::capsule owner(block, [](void* p) noexcept {
    try {
      host_pool_give_back(p);
    } catch (...) {  // a destructor must not throw; the block stays taken
    }
  });
  const nb::dlpack::dtype dt = dlpack_dtype(dtype);
  if (torch) {
    return nb::cast(nb::ndarray<nb::pytorch>(block, sizes.size(), sizes.data(), owner, nullptr, dt,
                                             nb::device::cpu::value));
  }
  return nb::cast(nb::ndarray<nb::numpy>(block, sizes.size(), sizes.data(), owner, nullptr, dt,
                                         nb::device::cpu::value));
}

void bind_host_memory(nb::module_& m) {
  m.def("pool_array", &pool_array, nb::arg("shape"), nb::arg("dtype"), nb::arg("torch"));
  m.def("set_huge_pages", &set_huge_pages, nb::arg("enabled"));
  m.def("huge_page_info", [] {
    const HugePageInfo info = huge_page_info();
    nb::dict d;
    d["enabled"] = info.enabled;
    d["thp_mode"] = info.thp_mode;
    d["advised_bytes"] = info.advised_bytes;
    d["page_bytes"] = info.sizes.page_bytes;
    d["huge_page_bytes"] = info.sizes.huge_page_bytes;
    d["block_bytes"] = info.sizes.block_bytes;
    return d;
  });
  m.def("advise_huge_pages", [](uintptr_t address, size_t bytes) {
    advise_huge_pages(reinterpret_cast<void*>(address), bytes);
  }, nb::arg("address"), nb::arg("bytes"));
  m.def("host_pool_configure", &host_pool_configure, nb::arg("enabled"), nb::arg("cap_bytes"));
  m.def("host_pool_release_free", &host_pool_release_free);
  m.def("host_pool_info", [] {
    const HostPoolInfo info = host_pool_info();
    nb::dict d;
    d["enabled"] = info.enabled;
    d["cap_bytes"] = info.cap_bytes;
    d["cached_bytes"] = info.cached_bytes;
    d["free_bytes"] = info.free_bytes;
    d["blocks"] = info.blocks;
    d["hits"] = info.hits;
    d["misses"] = info.misses;
    d["over_cap"] = info.over_cap;
    return d;
  });
}

}  // namespace

NB_MODULE(_leanstep, m) {
  m.doc() = "leanstep C++ library bindings (use the `leanstep` package)";
  m.attr("__version__") = kVersion;

  // leanstep::Error -> leanstep.Error (a ValueError), same message.
  nb::exception<Error>(m, "Error", PyExc_ValueError);

  m.def("num_threads", &num_threads, "Worker threads of parallel loops (results never depend on it).");
  m.def("set_num_threads", &set_num_threads, nb::arg("n"));
  m.def(
      "may_self_overlap",
      [](const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
        if (shape.size() != strides.size() || shape.size() > static_cast<size_t>(kMaxDims))
          throw Error("may_self_overlap: arguments 'shape' and 'strides' must have one entry per dim, at most " +
                      std::to_string(kMaxDims) + " dims (got " + std::to_string(shape.size()) + " and " +
                      std::to_string(strides.size()) + ")");
        Tensor t;
        t.ndim = static_cast<int>(shape.size());
        for (size_t d = 0; d < shape.size(); ++d) {
          t.shape[d] = shape[d];
          t.strides[d] = strides[d];
        }
        return t.may_self_overlap();
      },
      nb::arg("shape"), nb::arg("strides"),
      "Whether a view of this layout may reach one element by two indices (the rule "
      "every in-place op applies).");

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

  bind_host_memory(m);
  bind_exchange(m);

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
