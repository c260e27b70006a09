// Keys of tensor lists from C: what decides the memory each tensor of a list
// covers (address, device, dtype, shape, strides), read through DLPack's C
// exchange table without a Python call per tensor. The plan caches find a
// plan for a fresh list of fresh views by this key (bytes: exact, no hash
// collisions) at tens of nanoseconds a view.
#include "exchange.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string_view.h>

#include <fmt/format.h>

#include <leanstep/core.h>

namespace leanstep::py {
namespace {

constexpr uint32_t kExchangeMajor = 1;

// Types seen, and their tables (nullptr: none usable). Types are immortal in
// practice (torch.Tensor, nn.Parameter); a reference is held regardless.
std::vector<std::pair<PyTypeObject*, const ExchangeApi*>>& type_cache() {
  static auto* cache = new std::vector<std::pair<PyTypeObject*, const ExchangeApi*>>();
  return *cache;
}

// Whether `type` is torch.Tensor or torch.nn.Parameter themselves: the types
// whose objects always own (a view of) plain memory.
bool plain_torch_type(PyTypeObject* type) {
  nb::handle t(reinterpret_cast<PyObject*>(type));
  if (!nb::hasattr(t, "__module__") || !nb::hasattr(t, "__qualname__")) return false;
  const std::string module = nb::cast<std::string>(nb::str(t.attr("__module__")));
  const std::string name = nb::cast<std::string>(nb::str(t.attr("__qualname__")));
  return (module == "torch" && name == "Tensor") ||
         (module == "torch.nn.parameter" && name == "Parameter");
}

const ExchangeApi* lookup(PyTypeObject* type) {
  if (!plain_torch_type(type)) return nullptr;
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

// The key of a list: a byte string of every tensor's description, and a
// 64-bit hash of it (the cache's dict is keyed by the hash; a hit compares the
// bytes, a memcmp: exact, and cheaper than Python hashing the bytes anew).
//
// Records, each led by a tag word (so the string parses one way only: the key
// is exact, and tensors_from_key reads it back):
//   kFull:     tag, address, byte offset, device, dtype|flags|ndim, shape..., strides
//              (present where the flag kStridesGiven says the producer gave them)
//   kAdjacent: tag|ndim, shape...      (ndim != 1)
//   kAdjacent1: tag|numel              (1-d, numel < 2^56)
// An adjacent record stands for a compact row-major tensor of the previous
// one's device and dtype that starts, at byte offset 0, where the previous
// one, compact too, ends: the common grad list, fresh views laid end to end in
// one buffer, then costs one word a view instead of seven. Every fact of a
// full record follows from the previous record and the shape, so two lists
// have equal keys exactly when every tensor's facts are equal.
class KeyBuilder {
 public:
  explicit KeyBuilder(size_t n) { words_.reserve(n + 8); }

  // A builder that compares its words with `expected` (a key's bytes) as it makes
  // them, keeping none: mismatched() turns true at the first word that differs, so
  // a caller stops reading the list there; matched() says whether the whole key was
  // made, word for word.
  explicit KeyBuilder(std::string_view expected) : expected_(expected), matching_(true) {}

  bool mismatched() const { return mismatched_; }
  bool matched() const { return !mismatched_ && at_ * sizeof(uint64_t) == expected_.size(); }

  // False when `obj` cannot be described (the caller keys the list in Python).
  bool add(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (type != last_type_) {
      api_ = exchange_api(obj);
      last_type_ = type;
    }
    if (api_ == nullptr) return false;
    DLTensor t;
    if (api_->dltensor_from_py_object_no_sync(obj, &t) != 0) {
      PyErr_Clear();
      return false;
    }
    // More dims than a view holds: keyed in Python, where the library's own check
    // names the tensor (a record holds what tensors_from_key can read back).
    if (t.ndim < 0 || t.ndim > kMaxDims) return false;
    const uint64_t address = reinterpret_cast<uintptr_t>(t.data);
    const uint64_t device = (static_cast<uint64_t>(static_cast<uint32_t>(t.device.device_type)) << 32) |
                            static_cast<uint32_t>(t.device.device_id);
    const uint64_t dtype = (static_cast<uint64_t>(t.dtype.code) << 56) |
                           (static_cast<uint64_t>(t.dtype.bits) << 48) |
                           (static_cast<uint64_t>(t.dtype.lanes) << 32);
    // Compact row-major (strides absent or the canonical ones) and its numel.
    bool compact = t.ndim >= 0;
    uint64_t numel = 1;
    int64_t stride = 1;
    for (int d = t.ndim - 1; compact && d >= 0; --d) {
      if (t.shape[d] < 0 || (t.strides != nullptr && t.strides[d] != stride)) compact = false;
      stride *= t.shape[d];
      numel *= static_cast<uint64_t>(t.shape[d]);
    }
    const uint64_t element_bits = static_cast<uint64_t>(t.dtype.bits) * t.dtype.lanes;
    if (element_bits % 8 != 0) compact = false;  // sub-byte dtypes: no byte end
    const bool adjacent = have_previous_ && previous_compact_ && compact && t.byte_offset == 0 &&
                          address == previous_end_ && device == previous_device_ &&
                          dtype == previous_dtype_;
    if (adjacent && t.ndim == 1 && numel < (uint64_t{1} << 56)) {
      word(kAdjacent1 | numel);
    } else if (adjacent) {
      word(kAdjacent | static_cast<uint32_t>(t.ndim));
      for (int d = 0; d < t.ndim; ++d) word(static_cast<uint64_t>(t.shape[d]));
    } else {
      word(kFull);
      word(address);
      word(t.byte_offset);
      word(device);
      word(dtype | (t.strides != nullptr ? kStridesGiven : 0) | static_cast<uint32_t>(t.ndim));
      for (int d = 0; d < t.ndim; ++d) word(static_cast<uint64_t>(t.shape[d]));
      if (t.strides != nullptr)  // none: compact row-major
        for (int d = 0; d < t.ndim; ++d) word(static_cast<uint64_t>(t.strides[d]));
    }
    have_previous_ = true;
    previous_compact_ = compact;
    previous_end_ = address + t.byte_offset + numel * (element_bits / 8);
    previous_device_ = device;
    previous_dtype_ = dtype;
    return true;
  }

  nb::object result() const {
    return nb::make_tuple(nb::int_(static_cast<int64_t>(hash_)),
                          nb::bytes(words_.data(), words_.size() * sizeof(uint64_t)));
  }

  static constexpr uint64_t kFull = uint64_t{0xF1} << 56;
  static constexpr uint64_t kAdjacent = uint64_t{0xA2} << 56;
  static constexpr uint64_t kAdjacent1 = uint64_t{0xA1} << 56;
  static constexpr uint64_t kStridesGiven = uint64_t{1} << 16;  // in the dtype word's low half

 private:

  void word(uint64_t v) {
    if (matching_) {
      uint64_t w = 0;
      if (mismatched_ || (at_ + 1) * sizeof(uint64_t) > expected_.size()) {
        mismatched_ = true;
        return;
      }
      std::memcpy(&w, expected_.data() + at_++ * sizeof(uint64_t), sizeof w);
      mismatched_ = w != v;
      return;
    }
    words_.push_back(v);
    // A multiply-xorshift mix per word: a dict key, not a security boundary (a
    // collision costs one memcmp that says "different").
    hash_ = (hash_ ^ v) * 0x9E3779B97F4A7C15ull;
    hash_ ^= hash_ >> 29;
  }

  std::vector<uint64_t> words_;
  std::string_view expected_;  // match mode: the key compared against
  bool matching_ = false;
  bool mismatched_ = false;
  size_t at_ = 0;  // match mode: words compared so far
  uint64_t hash_ = 0x243F6A8885A308D3ull;
  PyTypeObject* last_type_ = nullptr;
  const ExchangeApi* api_ = nullptr;
  bool have_previous_ = false;
  bool previous_compact_ = false;
  uint64_t previous_end_ = 0;
  uint64_t previous_device_ = 0;
  uint64_t previous_dtype_ = 0;
};

// A lookup on a type, remembered with the type's version tag: CPython changes the
// tag whenever the type or a base is modified (an attribute replaced), so a
// remembered answer is used only while the tag stands, and looked up again after.
class TypeLookup {
 public:
  // Whether the answer remembered is for `type`, unmodified since.
  bool current(PyTypeObject* type) const {
    return type == type_ && version_ != 0 && type->tp_version_tag == version_ &&
           PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
  }

  // `name` on `type`'s MRO (borrowed), remembering the type and its tag; null when
  // absent or when the type has no valid tag (then nothing may be remembered: the
  // caller takes Python's own path each call).
  PyObject* lookup(PyTypeObject* type, PyObject* name) {
    type_ = type;
    PyObject* descr = _PyType_Lookup(type, name);  // assigns a version tag
    version_ = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
    return version_ != 0 ? descr : nullptr;
  }

 private:
  PyTypeObject* type_ = nullptr;
  unsigned int version_ = 0;
};

// getattr(obj, name) for a run of objects of one type, where the type finds
// `name` as a C getset descriptor (torch's Tensor.grad): the descriptor's getter is
// called straight, without the generic lookup per object. That is what
// PyObject_GetAttr does for such a type (a data descriptor wins over the
// instance's __dict__), so the result is the same.
class AttrGetter {
 public:
  explicit AttrGetter(PyObject* name) : name_(name) {}

  // New reference, or nullptr with a Python error set.
  PyObject* get(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (!type_.current(type)) refresh(type);
    if (getter_ != nullptr) return getter_(obj, closure_);
    return PyObject_GetAttr(obj, name_);
  }

  // Whether reading the attribute of an object of `type` runs no Python code of
  // its own: torch's C getter on torch.Tensor or Parameter themselves, or a plain
  // instance attribute (no descriptor on the type, the generic getattr). A
  // property, a __getattr__, a getter of a subclass that torch hands to its
  // __torch_function__ may do anything, such as drop another param's grad.
  bool quiet(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (!type_.current(type)) refresh(type);
    // A type that has DLPack's exchange table here is torch.Tensor or Parameter
    // themselves (exchange_api: remembered per type, no lookup in refresh, which
    // the general pass runs at every change of type).
    return quiet_ || (torch_getter_ && exchange_api(obj) != nullptr);
  }

 private:
  // The getter, or none (getattr then), for `type`; remembered with the type's
  // version tag either way, so a run of one type looks it up once.
  void refresh(PyTypeObject* type) {
    getter_ = nullptr;
    closure_ = nullptr;
    quiet_ = torch_getter_ = false;
    PyObject* descr = type_.lookup(type, name_);
    const bool tagged = type_.current(type);  // else nothing is remembered
    if (tagged && descr == nullptr && type->tp_getattro == PyObject_GenericGetAttr)
      quiet_ = true;  // the instance's own __dict__, if anything
    if (type->tp_getattro != PyObject_GenericGetAttr || descr == nullptr ||
        !Py_IS_TYPE(descr, &PyGetSetDescr_Type) || !PyType_IsSubtype(type, PyDescr_TYPE(descr)))
      return;  // getattr's own path (it raises where the descriptor is not for this type)
    const PyGetSetDef* def = reinterpret_cast<PyGetSetDescrObject*>(descr)->d_getset;
    if (def->get == nullptr) return;
    getter_ = def->get;
    closure_ = def->closure;
    torch_getter_ = tagged;  // quiet on torch's own types (see quiet)
  }

  PyObject* name_;
  TypeLookup type_;
  getter getter_ = nullptr;
  void* closure_ = nullptr;
  bool quiet_ = false;
  bool torch_getter_ = false;
};

// `obj.is_neg()` for a torch.Tensor or Parameter (the types exchange_view takes):
// where the type's `is_neg` is a C method taking no arguments (torch's is), its C
// function is called straight, without the per-call method lookup (the type's MRO,
// then the tensor's own __dict__, which a method, a non-data descriptor, must
// consult); it reads the tensor's own bit either way. A replacement of
// Tensor.is_neg is seen on the next call (TypeLookup), and one that is not such a
// C method is called as a method. Measured (one thread): about 95 ns less a tensor,
// a 1-row RMSNorm call through the extension (three tensors) 1.72 to 1.43 us.
class IsNegCall {
 public:
  // New reference, or nullptr with a Python error set.
  PyObject* operator()(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (!type_.current(type)) refresh(type);
    if (method_ != nullptr) return method_(obj, nullptr);
    return PyObject_CallMethodNoArgs(obj, name());
  }

 private:
  static PyObject* name() {
    static PyObject* const is_neg = PyUnicode_InternFromString("is_neg");
    return is_neg;
  }

  void refresh(PyTypeObject* type) {
    method_ = nullptr;
    PyObject* descr = type_.lookup(type, name());
    if (descr == nullptr || !Py_IS_TYPE(descr, &PyMethodDescr_Type) ||
        !PyType_IsSubtype(type, PyDescr_TYPE(descr)))
      return;  // called as a method: Python's own lookup
    const PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(descr)->d_method;
    if (def->ml_flags == METH_NOARGS) method_ = def->ml_meth;
  }

  TypeLookup type_;
  PyCFunction method_ = nullptr;
};

// The grads found, in order: a list allocated for every param up front, each
// grad's reference moved in (no append call, no second reference to take and
// drop), its size the count so far. Where the param list grew meanwhile (a
// getter that ran Python), it appends past the allocation.
class GradList {
 public:
  explicit GradList(Py_ssize_t capacity) : capacity_(capacity) {
    PyObject* list = PyList_New(capacity);
    if (list == nullptr) throw nb::python_error();
    Py_SET_SIZE(list, 0);  // empty, with room for `capacity` items
    list_ = nb::steal(list);
  }

  void add(nb::object grad) {
    PyObject* list = list_.ptr();
    const Py_ssize_t size = PyList_GET_SIZE(list);
    if (size < capacity_) {
      PyList_SET_ITEM(list, size, grad.release().ptr());
      Py_SET_SIZE(list, size + 1);
    } else if (PyList_Append(list, grad.ptr()) != 0) {
      throw nb::python_error();
    }
  }

  const nb::object& list() const { return list_; }

 private:
  nb::object list_;
  Py_ssize_t capacity_;
};

// Appends getattr(param, name, None) to `grads` and `key` unless it is None;
// false when the grad cannot be described (the caller answers None).
bool add_grad(PyObject* param, AttrGetter& get_grad, KeyBuilder& key, GradList& grads) {
  PyObject* grad = get_grad.get(param);
  if (grad == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw nb::python_error();
    PyErr_Clear();  // getattr(param, name, None)
    return true;
  }
  nb::object owned = nb::steal(grad);
  if (grad == Py_None) return true;
  if (!key.add(grad)) return false;
  grads.add(std::move(owned));
  return true;
}

// (hash, key) of a list or tuple of tensors, or None when some element cannot
// be described (no exchange table, a device DLPack has no code for...).
nb::object tensor_list_key(nb::handle tensors) {
  PyObject* seq = tensors.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return nb::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  KeyBuilder key(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!key.add(items[i])) return nb::none();
  return key.result();
}

// (grads, hash, key): the attribute `name` of each object of a list or tuple
// (a param's "grad" or "decoupled_grad"), those that are not None, in order,
// and their key; None when some grad cannot be described.
//
// With `flag`: only params whose attribute `flag` is `counted` take part, and
// those whose attribute is `skipped` are left out (a filter the caller
// evaluated once per param and cached on it); False when some param has
// neither (the caller evaluates the filter and asks again).
nb::object grads_and_key(nb::handle params, nb::str name, nb::object flag, nb::handle counted,
                         nb::handle skipped) {
  PyObject* seq = params.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq))
    throw nb::type_error("grads_and_key: argument 'params' must be a list or tuple");
  const bool filtered = !flag.is_none();
  GradList grads(PySequence_Fast_GET_SIZE(seq));
  KeyBuilder key(static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)));
  AttrGetter get_grad(name.ptr());
  // A param's attributes may run Python (a property) that changes a list: its size
  // and items are read afresh each step, and the param is held while it is read.
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const nb::object param = nb::borrow(PySequence_Fast_GET_ITEM(seq, i));
    if (filtered) {
      PyObject* mark = PyObject_GetAttr(param.ptr(), flag.ptr());
      if (mark == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw nb::python_error();
        PyErr_Clear();
        return nb::bool_(false);
      }
      Py_DECREF(mark);  // compared by identity only: the caller's sentinels stay alive
      if (mark == skipped.ptr()) continue;
      if (mark != counted.ptr()) return nb::bool_(false);
    }
    if (!add_grad(param.ptr(), get_grad, key, grads)) return nb::none();
  }
  nb::object out = key.result();
  return nb::make_tuple(grads.list(), out[0], out[1]);
}

// A caller's cached selection of a list's params: `ids`, the address of every param
// of that list, in order (the caller holds a weak reference to each and drops the
// selection when one dies, so an address names one object); `counted`, one byte per
// param, nonzero for the params that take part. Reads the bytes in place: the caller
// holds them for the call. Throws, naming `where`, on bytes that describe no list.
class Selection {
 public:
  Selection(const char* where, const nb::bytes& ids, const nb::bytes& counted)
      : ids_(ids.c_str()),
        counts_(reinterpret_cast<const unsigned char*>(counted.c_str())),
        size_(ids.size() / sizeof(uintptr_t)) {
    if (ids.size() % sizeof(uintptr_t) != 0 || counted.size() != size_)
      throw nb::value_error(fmt::format("{}: arguments 'ids' and 'counted' must describe one list "
                                        "(one address and one byte per param)", where).c_str());
  }

  size_t size() const { return size_; }

  // Whether `item` is the param at position `i` of the selection's list.
  bool holds_at(size_t i, PyObject* item) const {
    if (i >= size_) return false;
    uintptr_t expected;
    std::memcpy(&expected, ids_ + i * sizeof(uintptr_t), sizeof(expected));
    return reinterpret_cast<uintptr_t>(item) == expected;
  }

  bool counted(size_t i) const { return counts_[i] != 0; }

 private:
  const char* ids_;
  const unsigned char* counts_;
  size_t size_;
};

// Whether the key of getattr(p, name) over `params` (as grads_and_key makes it) is
// `key`, found in one pass that makes no list and no bytes and stops at the first
// word that differs: for a caller that keeps the key of the list it planned last
// (Megatron's fresh list of fresh views each step), a hit costs the attribute
// reads alone. None on a mismatch or a grad that cannot be described; on a match,
// the `index`-th of the grads that are not None (the one a device plan views its
// region through), or True where `index` is negative.
// With `name` None, the items are the grads themselves (a list tensor_list_key
// keys, where none is None). With `ids` and `counted` (a cached selection, as
// selected_grads_and_key takes them), only the params whose byte is nonzero take
// part, and a list that is not the selection's is no match.
// How far ahead the pass fetches its params: right after Megatron's own clip over 3168
// fresh views (one thread, 100 calls each, in one process), the pass took 315 us
// without, 308 at 4 ahead, 300 at 8, 298 at 12, 305 at 16.
constexpr Py_ssize_t kPrefetchAhead = 8;

nb::object grads_match_key(nb::handle params, nb::object name, nb::bytes key, Py_ssize_t index,
                           nb::object ids, nb::object counted) {
  PyObject* seq = params.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq))
    throw nb::type_error("grads_match_key: argument 'params' must be a list or tuple");
  if (!name.is_none() && !PyUnicode_Check(name.ptr()))
    throw nb::type_error("grads_match_key: argument 'name' must be a str or None");
  std::optional<Selection> selection;
  if (!ids.is_none() || !counted.is_none()) {
    if (!PyBytes_Check(ids.ptr()) || !PyBytes_Check(counted.ptr()) || name.is_none())
      throw nb::type_error("grads_match_key: arguments 'ids' and 'counted' must be bytes, "
                           "both given, with a name");
    selection.emplace("grads_match_key", nb::borrow<nb::bytes>(ids), nb::borrow<nb::bytes>(counted));
    if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) != selection->size()) return nb::none();
  }
  // The key's bytes, held for the call: a getter may run Python, never this object's.
  const nb::bytes expected = nb::borrow<nb::bytes>(key);
  KeyBuilder match(std::string_view(expected.c_str(), expected.size()));
  const bool items = name.is_none();
  AttrGetter get_grad(name.ptr());
  nb::object wanted = index < 0 ? nb::object(nb::bool_(true)) : nb::object();
  Py_ssize_t found = 0;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    // The param a few places ahead, fetched while this one is read (an address only:
    // nothing is dereferenced). Each read chases cold pointers from the param on.
    if (i + kPrefetchAhead < PySequence_Fast_GET_SIZE(seq))
      __builtin_prefetch(PySequence_Fast_GET_ITEM(seq, i + kPrefetchAhead));
    if (selection) {  // a getter may run Python that changes the list: checked afresh
      if (!selection->holds_at(static_cast<size_t>(i), item)) return nb::none();
      if (!selection->counted(static_cast<size_t>(i))) continue;
    }
    const nb::object param = nb::borrow(item);
    if (items) {
      if (param.is_none() || !match.add(param.ptr()) || match.mismatched()) return nb::none();
      if (found++ == index) wanted = param;
      continue;
    }
    // Unlike the general pass, this one keeps no grad past its read: it answers only
    // where nothing can change a grad it has read (no Python runs in a read) and every
    // grad is held by something else (its param), so the memory its key names is
    // alive when the caller's kernels run. A getter that makes its grad afresh (the
    // only holder is this pass) would have it freed, and its address reused.
    if (!get_grad.quiet(param.ptr())) return nb::none();
    PyObject* grad = get_grad.get(param.ptr());
    if (grad == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw nb::python_error();
      PyErr_Clear();  // getattr(param, name, None)
      continue;
    }
    nb::object owned = nb::steal(grad);
    if (grad == Py_None) continue;
    if (Py_REFCNT(grad) < 2 || !match.add(grad) || match.mismatched()) return nb::none();
    if (found++ == index) wanted = std::move(owned);
  }
  if (selection && static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) != selection->size())
    return nb::none();
  if (!match.matched() || !wanted.is_valid()) return nb::none();
  return wanted;
}

// The tensor `grad` is a view of (its `_base`; grad itself when it is no view),
// where that tensor is exactly one compact 1-d region: of `dtype` (a name the
// library knows) and grad's device, data at `address`, `numel` elements, and no
// tensor that requires grad (an in-place op
// would be refused on it). None otherwise. A device plan recalled through one grad
// (TorchGradPlan._region_as_base) checks its region so: one C call, where the same
// seven reads from Python (`_base`, dtype, requires_grad, dim, data_ptr, numel,
// stride) cost about 37 us right after Megatron's own clip over 3168 fresh views,
// each a cold path of torch's argument parser (one thread, median of 200).
// Only torch's own types are read (their C getters: no Python runs).
nb::object region_base(nb::handle grad, std::string_view dtype, uint64_t address, int64_t numel) {
  static AttrGetter get_base(PyUnicode_InternFromString("_base"));  // GIL held: one caller
  static AttrGetter get_requires_grad(PyUnicode_InternFromString("requires_grad"));
  DLTensor g;
  const ExchangeApi* api = exchange_api(grad.ptr());
  if (api == nullptr || !get_base.quiet(grad.ptr()) || api->dltensor_from_py_object_no_sync(grad.ptr(), &g) != 0) {
    PyErr_Clear();
    return nb::none();
  }
  PyObject* base = get_base.get(grad.ptr());
  if (base == nullptr) throw nb::python_error();
  nb::object root = base == Py_None ? nb::borrow(grad) : nb::steal(base);
  if (base == Py_None) Py_DECREF(base);
  DLTensor r;
  const ExchangeApi* root_api = exchange_api(root.ptr());
  if (root_api == nullptr || !get_requires_grad.quiet(root.ptr()) ||
      root_api->dltensor_from_py_object_no_sync(root.ptr(), &r) != 0) {
    PyErr_Clear();
    return nb::none();
  }
  if (r.ndim != 1 || r.shape[0] != numel || (numel > 1 && r.strides != nullptr && r.strides[0] != 1) ||
      reinterpret_cast<uintptr_t>(r.data) + r.byte_offset != address ||
      r.device.device_type != g.device.device_type || r.device.device_id != g.device.device_id)
    return nb::none();
  try {
    if (Tensor::from_dlpack(r, "region").dtype != dtype_from_name(dtype)) return nb::none();
  } catch (const Error&) {
    return nb::none();  // a dtype the library does not read: not the region
  }
  PyObject* requires_grad = get_requires_grad.get(root.ptr());
  if (requires_grad == nullptr) throw nb::python_error();
  const bool refused = requires_grad != Py_False;
  Py_DECREF(requires_grad);
  return refused ? nb::none() : root;
}

// (grads, hash, key) of the params a caller's cached selection (see Selection)
// counts, or False when `params` is not the list the selection was made for. The
// identity check runs as the pass reads each param: no per-param attribute read.
nb::object selected_grads_and_key(nb::handle params, nb::str name, nb::bytes ids,
                                  nb::bytes counted) {
  PyObject* seq = params.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq))
    throw nb::type_error("selected_grads_and_key: argument 'params' must be a list or tuple");
  const Selection selection("selected_grads_and_key", ids, counted);
  const size_t n_ids = selection.size();
  if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) != n_ids) return nb::bool_(false);
  GradList grads(static_cast<Py_ssize_t>(n_ids));
  KeyBuilder key(n_ids);
  AttrGetter get_grad(name.ptr());
  // As in grads_and_key, a getter may run Python that changes the list: its size
  // and items are read afresh each step.
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (!selection.holds_at(static_cast<size_t>(i), item)) return nb::bool_(false);
    if (!selection.counted(static_cast<size_t>(i))) continue;
    const nb::object param = nb::borrow(item);
    if (!add_grad(param.ptr(), get_grad, key, grads)) return nb::none();
  }
  if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) != n_ids) return nb::bool_(false);
  nb::object out = key.result();
  return nb::make_tuple(grads.list(), out[0], out[1]);
}

// Calls visit(dl) with each record of a key read back as the DLTensor it
// describes (a view valid during the call). Throws leanstep::Error on bytes that
// are not a key, naming `kWhere`, the caller.
template <class Visit>
void for_each_record(const char* kWhere, std::string_view key, Visit&& visit) {
  if (key.size() % sizeof(uint64_t) != 0)
    throw Error(fmt::format("{}: internal: a key is whole 64-bit words (got {} bytes)", kWhere, key.size()));
  const size_t n = key.size() / sizeof(uint64_t);
  size_t at = 0;
  auto next = [&]() {
    if (at >= n) throw Error(fmt::format("{}: internal: the key ends inside a record", kWhere));
    uint64_t w;
    std::memcpy(&w, key.data() + at++ * sizeof(uint64_t), sizeof w);
    return w;
  };
  DLTensor dl{};
  int64_t shape[kMaxDims], strides[kMaxDims];
  bool first = true;
  uint64_t end = 0;  // where the previous tensor ends (its records' state, as KeyBuilder's)
  while (at < n) {
    const uint64_t tag = next();
    const uint64_t kind = tag & (uint64_t{0xFF} << 56);
    if (kind == KeyBuilder::kFull) {
      const uint64_t address = next(), offset = next(), device = next(), dtype = next();
      dl.data = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
      dl.byte_offset = offset;
      dl.device.device_type = static_cast<DLDeviceType>(static_cast<int32_t>(device >> 32));
      dl.device.device_id = static_cast<int32_t>(device & 0xFFFFFFFFu);
      dl.dtype.code = static_cast<uint8_t>(dtype >> 56);
      dl.dtype.bits = static_cast<uint8_t>(dtype >> 48);
      dl.dtype.lanes = static_cast<uint16_t>(dtype >> 32);
      dl.ndim = static_cast<int>(dtype & 0xFF);
      if (dl.ndim > kMaxDims) throw Error(fmt::format("{}: internal: {} dims in a key", kWhere, dl.ndim));
      for (int d = 0; d < dl.ndim; ++d) shape[d] = static_cast<int64_t>(next());
      const bool given = (dtype & KeyBuilder::kStridesGiven) != 0;
      for (int d = 0; given && d < dl.ndim; ++d) strides[d] = static_cast<int64_t>(next());
      dl.shape = shape;
      dl.strides = given ? strides : nullptr;
    } else if (kind == KeyBuilder::kAdjacent || kind == KeyBuilder::kAdjacent1) {
      // Compact, at byte offset 0 where the previous one (compact) ends, its device and dtype.
      if (first) throw Error(fmt::format("{}: internal: a key starts with an adjacent record", kWhere));
      dl.data = reinterpret_cast<void*>(static_cast<uintptr_t>(end));
      dl.byte_offset = 0;
      if (kind == KeyBuilder::kAdjacent1) {
        dl.ndim = 1;
        shape[0] = static_cast<int64_t>(tag & ~(uint64_t{0xFF} << 56));
      } else {
        dl.ndim = static_cast<int>(tag & 0xFF);
        if (dl.ndim > kMaxDims) throw Error(fmt::format("{}: internal: {} dims in a key", kWhere, dl.ndim));
        for (int d = 0; d < dl.ndim; ++d) shape[d] = static_cast<int64_t>(next());
      }
      dl.shape = shape;
      dl.strides = nullptr;
    } else {
      throw Error(fmt::format("{}: internal: no record starts with the tag {:#x}", kWhere, tag >> 56));
    }
    visit(static_cast<const DLTensor&>(dl));
    first = false;
    uint64_t numel = 1;
    for (int d = 0; d < dl.ndim; ++d) numel *= static_cast<uint64_t>(shape[d]);
    end = reinterpret_cast<uintptr_t>(dl.data) + dl.byte_offset +
          numel * (static_cast<uint64_t>(dl.dtype.bits) * dl.dtype.lanes / 8);
  }
}

// The dtype name of a DLPack dtype, for the ones a grad plan takes; "other" else.
const char* plan_dtype_name(const DLDataType& t) {
  if (t.lanes != 1) return "other";
  if (t.code == kDLFloat && t.bits == 32) return "float32";
  if (t.code == kDLFloat && t.bits == 16) return "float16";
  if (t.code == kDLBfloat && t.bits == 16) return "bfloat16";
  if (t.code == kDLFloat && t.bits == 64) return "float64";
  return "other";
}

// (on the CPU, dtypes): whether every tensor a key describes lives in CPU memory,
// and the names of their dtypes (plan_dtype_name), each once: what a grad plan
// cache asks of a fresh list before planning it, from the key it read already.
nb::tuple key_facts(nb::bytes key) {
  bool on_cpu = true;
  std::vector<const char*> names;
  const std::string_view bytes(static_cast<const char*>(key.data()), key.size());
  for_each_record("key_facts", bytes, [&](const DLTensor& dl) {
    on_cpu = on_cpu && dl.device.device_type == kDLCPU;
    const char* name = plan_dtype_name(dl.dtype);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  });
  nb::list out;
  for (const char* name : names) out.append(nb::str(name));
  return nb::make_tuple(on_cpu, nb::tuple(out));
}

}  // namespace

std::vector<Tensor> tensors_from_key(std::string_view key) {
  std::vector<Tensor> tensors;
  tensors.reserve(key.size() / sizeof(uint64_t));
  for_each_record("tensors_from_key", key, [&](const DLTensor& dl) { tensors.push_back(Tensor::from_dlpack(dl, "key record")); });
  return tensors;
}

const ExchangeApi* exchange_api(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  for (const auto& [cached, api] : type_cache())
    if (cached == type) return api;
  const ExchangeApi* api = lookup(type);
  Py_INCREF(reinterpret_cast<PyObject*>(type));
  type_cache().emplace_back(type, api);
  return api;
}

ExchangeView exchange_view(PyObject* obj, DLTensor* out) {
  const ExchangeApi* api = exchange_api(obj);
  if (api == nullptr) return ExchangeView::kNone;
  static IsNegCall is_neg;  // called with the GIL held: one caller at a time
  PyObject* negated = is_neg(obj);
  if (negated == nullptr) {
    PyErr_Clear();
    return ExchangeView::kRefused;
  }
  const bool refuse = negated != Py_False;
  Py_DECREF(negated);
  if (refuse) return ExchangeView::kRefused;
  if (api->dltensor_from_py_object_no_sync(obj, out) != 0) {
    PyErr_Clear();
    return ExchangeView::kRefused;
  }
  return ExchangeView::kViewed;
}

namespace {

// Whether every argument that is not None is a plain torch CPU tensor (Tensor or
// Parameter, not a subclass) of a kernel dtype, contiguous and not a negated view:
// the MoE calls' lean path (leanstep.torch._lean_moe_call), one C pass where the
// same checks in Python cost about 0.3 us a tensor.
bool lean_cpu_tensors(nb::args tensors) {
  for (nb::handle obj : tensors) {
    if (obj.is_none()) continue;
    DLTensor t;
    if (exchange_view(obj.ptr(), &t) != ExchangeView::kViewed || t.device.device_type != kDLCPU)
      return false;
    // The library's own reading of a view (its dtypes: _arrays.SUPPORTED_DTYPES; its dims)
    // and torch's contiguity rule (Tensor::is_contiguous). A view it cannot read (another
    // dtype, too many dims) is not the lean path's: the router names it.
    try {
      if (!Tensor::from_dlpack(t).is_contiguous()) return false;
    } catch (const Error&) {
      return false;
    }
  }
  return true;
}

}  // namespace

void bind_exchange(nb::module_& m) {
  m.def("lean_cpu_tensors", &lean_cpu_tensors,
        "Whether every argument that is not None is a plain torch CPU tensor of a kernel "
        "dtype, contiguous and not a negated view.");
  m.def("key_facts", &key_facts, nb::arg("key"),
        "(on_cpu, dtypes) of the tensors a list key describes: whether all live in CPU "
        "memory, and their dtypes' names (float32, float16, bfloat16, float64, or other), "
        "each once, in order of first appearance.");
  m.def("tensor_list_key", &tensor_list_key, nb::arg("tensors"),
        "(hash, key): key, bytes naming every tensor's address, device, dtype, shape and "
        "strides, read from C through DLPack's exchange table, and a 64-bit hash of it; None "
        "when some element has no such description (key that list in Python).");
  m.def("grads_and_key", &grads_and_key, nb::arg("params"), nb::arg("name"),
        nb::arg("flag").none() = nb::none(), nb::arg("counted").none() = nb::none(),
        nb::arg("skipped").none() = nb::none(),
        "(grads, hash, key): getattr(p, name, None) of every p, the non-None ones in order, "
        "and their key as tensor_list_key gives it; None when some grad has no description. "
        "With flag: only params whose attribute flag is counted (those whose flag is skipped "
        "are left out); False when a param has neither.");
  m.def("grads_match_key", &grads_match_key, nb::arg("params"), nb::arg("name").none(),
        nb::arg("key"),
        nb::arg("index") = -1, nb::arg("ids").none() = nb::none(),
        nb::arg("counted").none() = nb::none(),
        "Whether grads_and_key(params, name) would give the key `key` (bytes), in one pass "
        "that stops at the first difference: None if not (or a grad cannot be described), "
        "else the index-th grad that is not None (True for a negative index). With name "
        "None, whether tensor_list_key(params) would (the items are the grads; None if "
        "one is None). With ids and counted, as selected_grads_and_key takes them: of the "
        "counted params of that list only (None for another list).");
  m.def("region_base", &region_base, nb::arg("grad"), nb::arg("dtype"), nb::arg("address"),
        nb::arg("numel"),
        "The tensor grad is a view of (grad itself when it is no view) where that tensor is "
        "one compact 1-d region of dtype (a name: float32, ...) and grad's device at address, of numel elements, "
        "and does not require grad; else None. torch.Tensor and Parameter only.");
  m.def("selected_grads_and_key", &selected_grads_and_key, nb::arg("params"), nb::arg("name"),
        nb::arg("ids"), nb::arg("counted"),
        "(grads, hash, key) as grads_and_key gives them for the params whose byte in counted "
        "is nonzero; False when params is not the list ids names (one address per param, in "
        "order), None when some grad has no description.");
  m.def("has_exchange_api", [](nb::handle obj) { return exchange_api(obj.ptr()) != nullptr; },
        nb::arg("obj"), "Whether obj's type offers DLPack's C exchange table.");
}

}  // namespace leanstep::py
