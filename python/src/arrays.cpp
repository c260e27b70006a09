#include "arrays.h"

#include <cstdint>
#include <string>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace leanstep::py {

Tensor to_tensor(const InArray& array, std::string_view arg) {
  return Tensor::from_dlpack(array.dl, arg);
}
Tensor to_tensor(const OutArray& array, std::string_view arg) {
  return Tensor::from_dlpack(array.dl, arg);
}

Tensor meta_tensor(const nb::tuple& meta, std::string_view where, std::string_view arg) {
  if (meta.size() != 4)
    throw_arg_error(where, arg, "internal: metadata must be (address, dtype, shape, strides)");
  const auto shape = nb::cast<std::vector<int64_t>>(meta[2]);
  const auto strides = nb::cast<std::vector<int64_t>>(meta[3]);
  if (shape.size() > static_cast<size_t>(kMaxDims) || strides.size() != shape.size())
    throw_arg_error(where, arg, "must have at most 8 dims (got " + std::to_string(shape.size()) + ")");
  Tensor t;
  t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(nb::cast<uint64_t>(meta[0])));
  t.dtype = dtype_from_name(nb::cast<std::string>(meta[1]));
  t.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = shape[static_cast<size_t>(d)];
    t.strides[d] = strides[static_cast<size_t>(d)];
  }
  return t;
}

}  // namespace leanstep::py
