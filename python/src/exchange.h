// DLPack's C exchange protocol: a tensor type's table of C functions
// (`type(t).__dlpack_c_exchange_api__`, a capsule named "dlpack_exchange_api";
// DLPack 1.2+, native in torch 2.10+) that describe an object as a DLTensor in
// tens of nanoseconds, with no capsule and no Python call per tensor.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <dlpack/dlpack.h>
#include <nanobind/nanobind.h>

#include <leanstep/core.h>


namespace leanstep::py {

namespace nb = nanobind;

// The table's ABI as the DLPack 1.3 header lays it out. The system's
// dlpack.h (0.6) predates the protocol; DLTensor itself is unchanged.
struct ExchangeApiVersion {
  uint32_t major;
  uint32_t minor;
};

struct ExchangeApiHeader {
  ExchangeApiVersion version;
  ExchangeApiHeader* prev_api;
};

struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // A non-owning view of py_object, valid until control returns to Python.
  // 0 on success; -1 with a Python exception set.
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  void* current_work_stream;
};

// The exchange table of `obj`'s type (cached per type), or nullptr when the
// type has none this code can use (no attribute, another major version, no
// non-owning export).
const ExchangeApi* exchange_api(PyObject* obj);

enum class ExchangeView {
  kViewed,   // `out` describes the object
  kNone,     // no exchange table for this object (import it some other way)
  kRefused,  // a torch tensor that must not be handed over as memory at all
};

// A non-owning DLTensor of `obj`, valid while it lives, through its type's
// exchange table: torch.Tensor and torch.nn.Parameter only (a subclass may
// hold no memory of its own: DTensor, fake and functional tensors). A tensor
// with the negative bit set (a lazy negation: DLPack would describe the
// un-negated memory, a silently wrong sign) is refused. No Python error is
// left set.
ExchangeView exchange_view(PyObject* obj, DLTensor* out);

// The tensors a list key describes (tensor_list_key's bytes, read back): each
// one's address, dtype, device, shape and strides, as the key's producer saw them
// when it made the key, without the tensors. Throws leanstep::Error on bytes
// that are not such a key.
std::vector<Tensor> tensors_from_key(std::string_view key);

void bind_exchange(nb::module_& m);

}  // namespace leanstep::py
