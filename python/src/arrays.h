// Turning DLPack arrays that nanobind received (torch CPU tensors, NumPy
// arrays, anything with __dlpack__) into leanstep::Tensor views, zero-copy.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <leanstep/core.h>

namespace leanstep::py {

namespace nb = nanobind;

// Any dtype, shape and device. Inputs accept read-only arrays; arrays that
// the library writes (outputs, in-place arguments) must be writable, so a
// read-only NumPy array passed as an output is refused by nanobind itself.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

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
