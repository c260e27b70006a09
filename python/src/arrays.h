// Turning DLPack arrays that nanobind received (torch CPU tensors, NumPy
// arrays, anything with __dlpack__) into leanstep::Tensor views, zero-copy.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <leanstep/core.h>

#include "exchange.h"

namespace leanstep::py {

namespace nb = nanobind;

// An array argument: any dtype, shape and device, as a DLTensor valid for the
// call. A torch.Tensor or Parameter is described through DLPack's C exchange
// table (tens of nanoseconds, no capsule, no Python call; exchange.h); anything
// else (NumPy arrays, capsules, other __dlpack__ producers) through nanobind's
// ndarray import. Inputs accept read-only arrays; arrays that the library
// writes (outputs, in-place arguments) must be writable, so a read-only NumPy
// array passed as an output is refused by nanobind itself.
template <bool Writable>
struct ArrayArg {
  DLTensor dl{};
  nb::object keep;  // the object the view is of (its memory lives while it does)
  std::optional<std::conditional_t<Writable, nb::ndarray<>, nb::ndarray<nb::ro>>> imported;
};
using InArray = ArrayArg<false>;
using OutArray = ArrayArg<true>;

// A view of the array's memory; `arg` names it in error messages. Throws
// leanstep::Error for dtypes the library does not know (complex, fp8, ...).
Tensor to_tensor(const InArray& array, std::string_view arg);
Tensor to_tensor(const OutArray& array, std::string_view arg);

// A tensor's metadata from Python, (address, dtype name, shape, strides in
// elements), as a view that is never read: the device backends' checks with
// the C++ rules (leanstep._rules).
Tensor meta_tensor(const nb::tuple& meta, std::string_view where, std::string_view arg);

template <class Array>
std::optional<Tensor> to_tensor(const std::optional<Array>& array, std::string_view arg) {
  if (!array) return std::nullopt;
  return to_tensor(*array, arg);
}

// "<arg>[i]" views of a list of arrays.
template <class Array>
std::vector<Tensor> to_tensors(const std::vector<Array>& arrays, std::string_view arg) {
  std::vector<Tensor> views;
  views.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    views.push_back(to_tensor(arrays[i], std::string(arg) + "[" + std::to_string(i) + "]"));
  }
  return views;
}

}  // namespace leanstep::py

namespace nanobind::detail {

template <bool Writable>
struct type_caster<leanstep::py::ArrayArg<Writable>> {
  using Imported = std::conditional_t<Writable, ndarray<>, ndarray<ro>>;
  NB_TYPE_CASTER(leanstep::py::ArrayArg<Writable>, const_name("ndarray"))

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    switch (leanstep::py::exchange_view(src.ptr(), &value.dl)) {
      case leanstep::py::ExchangeView::kViewed:
        value.keep = borrow(src);
        return true;
      case leanstep::py::ExchangeView::kRefused:
        return false;  // the Python layer says why (leanstep._arrays.export)
      case leanstep::py::ExchangeView::kNone:
        break;
    }
    make_caster<Imported> inner;
    if (!inner.from_python(src, flags, cleanup)) return false;
    Imported& array = inner.value;
    DLTensor& dl = value.dl;
    // data() already includes the DLPack byte offset.
    dl.data = const_cast<void*>(static_cast<const void*>(array.data()));
    dl.device = DLDevice{static_cast<DLDeviceType>(array.device_type()),
                         static_cast<int32_t>(array.device_id())};
    dl.ndim = static_cast<int32_t>(array.ndim());
    const dlpack::dtype dtype = array.dtype();
    dl.dtype = DLDataType{dtype.code, dtype.bits, dtype.lanes};
    dl.shape = const_cast<int64_t*>(array.shape_ptr());
    dl.strides = const_cast<int64_t*>(array.stride_ptr());
    dl.byte_offset = 0;
    value.imported = std::move(array);
    value.keep = borrow(src);
    return true;
  }

  static handle from_cpp(const leanstep::py::ArrayArg<Writable>&, rv_policy,
                         cleanup_list*) noexcept {
    return handle();  // arguments only: never returned to Python
  }
};

}  // namespace nanobind::detail
