// Keys of tensor lists from C: what decides the memory each tensor of a list
// covers (address, device, dtype, shape, strides), read through DLPack's C
// exchange table without a Python call per tensor. The plan caches find a
// plan for a fresh list of fresh views by this key (bytes: exact, no hash
// collisions) at tens of nanoseconds a view.
#include "exchange.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>

namespace leanstep::py {
namespace {

constexpr uint32_t kExchangeMajor = 1;

// Types seen, and their tables (nullptr: none usable). Types are immortal in
// practice (torch.Tensor, nn.Parameter); a reference is held regardless.
std::vector<std::pair<PyTypeObject*, const ExchangeApi*>>& type_cache() {
  static auto* cache = new std::vector<std::pair<PyTypeObject*, const ExchangeApi*>>();
  return *cache;
}

const ExchangeApi* lookup(PyTypeObject* type) {
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type),
                                             "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const ExchangeApi* api = nullptr;
  if (PyCapsule_CheckExact(capsule)) {
    api = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
    if (api == nullptr) PyErr_Clear();
  }
  Py_DECREF(capsule);
  if (api != nullptr &&
      (api->header.version.major != kExchangeMajor || api->dltensor_from_py_object_no_sync == nullptr))
    api = nullptr;
  return api;
}

template <class T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

// None when any element cannot be described (not a tensor with an exchange
// table, a device DLPack has no code for, a tensor that requires grad...):
// the caller keys that list in Python instead.
nb::object tensor_list_key(nb::handle list) {
  PyObject* seq = list.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return nb::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::string key;
  key.reserve(static_cast<size_t>(n) * 64);
  PyTypeObject* last_type = nullptr;
  const ExchangeApi* api = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyTypeObject* type = Py_TYPE(items[i]);
    if (type != last_type) {
      api = exchange_api(items[i]);
      last_type = type;
    }
    if (api == nullptr) return nb::none();
    DLTensor t;
    if (api->dltensor_from_py_object_no_sync(items[i], &t) != 0) {
      PyErr_Clear();
      return nb::none();
    }
    put(key, reinterpret_cast<uintptr_t>(t.data));
    put(key, t.byte_offset);
    put(key, static_cast<int32_t>(t.device.device_type));
    put(key, static_cast<int32_t>(t.device.device_id));
    put(key, t.dtype.code);
    put(key, t.dtype.bits);
    put(key, t.dtype.lanes);
    put(key, t.ndim);
    for (int d = 0; d < t.ndim; ++d) put(key, t.shape[d]);
    if (t.strides == nullptr) {
      put(key, int64_t{-1});  // compact row-major: no strides given
    } else {
      for (int d = 0; d < t.ndim; ++d) put(key, t.strides[d]);
    }
  }
  return nb::bytes(key.data(), key.size());
}

}  // namespace

const ExchangeApi* exchange_api(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  for (const auto& [cached, api] : type_cache())
    if (cached == type) return api;
  const ExchangeApi* api = lookup(type);
  Py_INCREF(reinterpret_cast<PyObject*>(type));
  type_cache().emplace_back(type, api);
  return api;
}

void bind_exchange(nb::module_& m) {
  m.def("tensor_list_key", &tensor_list_key, nb::arg("tensors"),
        "bytes naming every tensor's address, device, dtype, shape and strides, read from C "
        "through DLPack's exchange table; None when some element has no such description "
        "(key that list in Python).");
  m.def("has_exchange_api", [](nb::handle obj) { return exchange_api(obj.ptr()) != nullptr; },
        nb::arg("obj"), "Whether obj's type offers DLPack's C exchange table.");
}

}  // namespace leanstep::py
