#include "arrays.h"

namespace leanstep::py {
namespace {

template <class Array>
Tensor view_of(const Array& array, std::string_view arg) {
  DLTensor dl{};
  // data() already includes the DLPack byte offset.
  dl.data = const_cast<void*>(static_cast<const void*>(array.data()));
  dl.device = DLDevice{static_cast<DLDeviceType>(array.device_type()),
                       static_cast<int32_t>(array.device_id())};
  dl.ndim = static_cast<int32_t>(array.ndim());
  const nb::dlpack::dtype dtype = array.dtype();
  dl.dtype = DLDataType{dtype.code, dtype.bits, dtype.lanes};
  dl.shape = const_cast<int64_t*>(array.shape_ptr());
  dl.strides = const_cast<int64_t*>(array.stride_ptr());
  dl.byte_offset = 0;
  return Tensor::from_dlpack(dl, arg);
}

}  // namespace

Tensor to_tensor(const InArray& array, std::string_view arg) { return view_of(array, arg); }
Tensor to_tensor(const OutArray& array, std::string_view arg) { return view_of(array, arg); }

}  // namespace leanstep::py
