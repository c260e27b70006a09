// leanstep core: dtypes, non-owning tensor views, errors, counters, threads.
//
// Everything else in the library builds on these types. A Tensor never owns
// memory: callers allocate outputs (including 1-element "backend scalars"
// such as a norm or a found_inf flag) and pass views.
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <dlpack/dlpack.h>

namespace leanstep {

inline constexpr const char* kVersion = "0.1.0";

// ---------------------------------------------------------------- errors

// The one error type of the library. Messages name the argument and the rule
// it broke, e.g. "clip: argument 'max_norm' must be finite and >= 0 (got nan)".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws Error("<where>: argument '<arg>' <rule>").
[[noreturn]] void throw_arg_error(std::string_view where, std::string_view arg,
                                  std::string_view rule);

// Checks `cond`; on failure throws Error naming the function, argument and rule.
// `rule` may be any expression convertible to std::string (e.g. fmt::format(...)),
// evaluated only on failure.
#define LEANSTEP_CHECK_ARG(cond, where, arg, rule)           \
  do {                                                       \
    if (!(cond)) ::leanstep::throw_arg_error(where, arg, rule); \
  } while (0)

// ---------------------------------------------------------------- dtypes

enum class DType : uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat64,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "float32", "float16", "bfloat16", ...
DType dtype_from_name(std::string_view name);  // accepts "fp32"/"float32", "bf16"/"bfloat16", ...
bool is_floating(DType dtype);

// ---------------------------------------------------------------- devices

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device&) const = default;
};

const char* device_name(DeviceType type);

// ---------------------------------------------------------------- tensor views

inline constexpr int kMaxDims = 8;

// A non-owning strided view. Strides are in ELEMENTS (as DLPack).
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  Device device{};

  Tensor() = default;
  // Contiguous row-major view.
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = {});
  static Tensor contiguous(void* data, DType dtype, const int64_t* shape, int ndim,
                           Device device = {});
  // Builds a view from a DLPack tensor; `arg` names it in error messages.
  // Rejects unsupported dtypes (e.g. complex, fp8, vector lanes) and null data with numel > 0.
  static Tensor from_dlpack(const DLTensor& dl, std::string_view arg = "tensor");

  int64_t numel() const;
  int64_t size(int dim) const;  // negative dims count from the end
  size_t element_size() const { return dtype_size(dtype); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  // Row-major dense. The strides of size-1 dims, and of a tensor with no
  // element at all, do not matter (torch and NumPy give empty arrays any).
  bool is_contiguous() const;
  // True when two different indices may reach one element (a stride-0 dim of
  // size > 1, as expand() makes, or strides too small for the sizes below
  // them). Conservative: an unusual layout that cannot be proved free of
  // overlap counts as overlapping. In-place writes refuse such views.
  bool may_self_overlap() const;
  bool empty() const { return numel() == 0; }
  // Byte range [begin, end) of memory the view can touch (begin == end when empty).
  uintptr_t byte_begin() const;
  uintptr_t byte_end() const;

  template <class T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
  // A contiguous view of the same memory with a new shape (numel must match).
  Tensor reshaped(std::initializer_list<int64_t> new_shape) const;
  std::string describe() const;  // "bfloat16[4096, 2048] cpu"
};

// Plain-data forms of a list of views and of an optional count, for the op
// signatures that cross the backend ABI (leanstep/ops.h): their layout is fixed
// here, not by the standard library a backend was built with. A TensorList
// converts implicitly from a span or vector of views, an OptionalInt64 from
// std::optional<int64_t>, an integer or std::nullopt, so callers pass those as
// before.
struct TensorList {
  const Tensor* data = nullptr;
  size_t size = 0;

  constexpr TensorList() = default;
  constexpr TensorList(const Tensor* data, size_t size) : data(data), size(size) {}
  template <class Range>
    requires std::convertible_to<Range&&, std::span<const Tensor>>
  constexpr TensorList(Range&& range) {  // NOLINT: implicit on purpose
    const std::span<const Tensor> s(std::forward<Range>(range));
    data = s.data();
    size = s.size();
  }
  constexpr std::span<const Tensor> span() const { return {data, size}; }
  constexpr operator std::span<const Tensor>() const { return span(); }  // NOLINT
  constexpr const Tensor* begin() const { return data; }
  constexpr const Tensor* end() const { return data + size; }
  constexpr const Tensor& operator[](size_t i) const { return data[i]; }
  constexpr bool empty() const { return size == 0; }
};

struct OptionalInt64 {
  int64_t value = 0;
  bool has_value = false;

  constexpr OptionalInt64() = default;
  constexpr OptionalInt64(std::nullopt_t) {}  // NOLINT: implicit on purpose
  constexpr OptionalInt64(int64_t v) : value(v), has_value(true) {}  // NOLINT
  constexpr OptionalInt64(std::optional<int64_t> v)  // NOLINT
      : value(v.value_or(0)), has_value(v.has_value()) {}
  constexpr operator std::optional<int64_t>() const {  // NOLINT
    return has_value ? std::optional<int64_t>(value) : std::nullopt;
  }
};

// Validates a view: null data with numel > 0, negative sizes, too many dims.
void check_tensor(const Tensor& t, std::string_view where, std::string_view arg);
void check_dtype(const Tensor& t, std::initializer_list<DType> allowed, std::string_view where,
                 std::string_view arg);
void check_cpu(const Tensor& t, std::string_view where, std::string_view arg);
// Error unless !t.may_self_overlap(): an in-place write through a view that
// reaches one element by two indices would write it twice.
void check_no_self_overlap(const Tensor& t, std::string_view where, std::string_view arg);

// ---------------------------------------------------------------- scalar conversions

// IEEE round-to-nearest-even conversions; NaN stays NaN, overflow becomes inf.
float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);
// Exact (bf16 is fp32's upper half), and inline: per-element loops that widen bf16
// (the reference kernels, the torch-order sum) vectorise instead of calling out.
inline float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}
uint16_t float_to_bf16(float value);

// Reads element i (flat index into contiguous memory) of `data` of `dtype` as double.
double load_as_double(const void* data, DType dtype, int64_t i);
// Writes `value` into element i, rounding once to the destination dtype.
void store_from_double(void* data, DType dtype, int64_t i, double value);

// Bulk conversions (SIMD, Google Highway). n elements, contiguous.
void convert_to_f32(const void* src, DType src_dtype, float* dst, int64_t n);
void convert_from_f32(const float* src, void* dst, DType dst_dtype, int64_t n);

// ---------------------------------------------------------------- counters

// Counters a test can read to prove that work is batched and the host never waits.
struct Counters {
  uint64_t dispatches = 0;  // parallel regions (CPU) / kernel launches (accelerators)
  uint64_t host_reads = 0;  // reads of a backend scalar by the host
};
Counters counters();
void reset_counters();
void count_dispatch();
void count_host_read();

// Reads a 1-element backend scalar on the host (counted as a host read).
double read_scalar(const Tensor& scalar);

// ---------------------------------------------------------------- threads

// Number of worker threads used by parallel loops (OpenMP). Results never depend on it.
// In a child created by fork() the loops run on the calling thread alone
// (GNU OpenMP's pool does not survive fork: a parallel loop there would hang),
// and num_threads() is 1.
int num_threads();
// n in [1, kMaxThreads]; otherwise Error naming the bound.
void set_num_threads(int n);
inline constexpr int kMaxThreads = 1024;

}  // namespace leanstep
