// An owning, 64-byte aligned, zero-initialised host allocation with a Tensor
// view. For callers (tests, benchmarks, the CLI, the training step) that need
// to allocate outputs; the library's ops themselves never allocate outputs.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <vector>

#include "leanstep/core.h"
#include "leanstep/host_memory.h"

namespace leanstep {

class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, std::initializer_list<int64_t> shape) : Buffer(dtype, std::vector<int64_t>(shape)) {}
  Buffer(DType dtype, const std::vector<int64_t>& shape) {
    if (shape.size() > static_cast<size_t>(kMaxDims))
      throw_arg_error("Buffer", "shape", "must have at most 8 dims");
    int64_t n = 1;
    for (int64_t s : shape) {
      if (s < 0) throw_arg_error("Buffer", "shape", "must have non-negative sizes");
      n *= s;
    }
    const size_t bytes = (static_cast<size_t>(n) * dtype_size(dtype) + 63) / 64 * 64;
    // Large: block-aligned, advised as huge pages, zeroed by the worker threads.
    void* p = host_alloc_zeroed(bytes);
    if (bytes && !p) throw Error("Buffer: out of memory");
    storage_.reset(p);
    view_ = Tensor::contiguous(p, dtype, shape.data(), static_cast<int>(shape.size()));
  }
  const Tensor& view() const { return view_; }
  Tensor& view() { return view_; }
  operator const Tensor&() const { return view_; }  // NOLINT: a Buffer is usable wherever a view is
  void* data() const { return view_.data; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(view_.data);
  }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> storage_;
  Tensor view_;
};

}  // namespace leanstep
