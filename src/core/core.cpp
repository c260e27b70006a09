#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>

#include "leanstep/core.h"
#include "core/parallel.h"

namespace leanstep {

void throw_arg_error(std::string_view where, std::string_view arg, std::string_view rule) {
  throw Error(fmt::format("{}: argument '{}' {}", where, arg, rule));
}

// ---------------------------------------------------------------- dtypes

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kInt32: return 4;
    case DType::kInt16: return 2;
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
    case DType::kBool: return 1;
  }
  throw Error(fmt::format("dtype_size: unknown dtype code {}", static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kInt16: return "int16";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  struct Alias { std::string_view name; DType dtype; };
  static constexpr Alias kAliases[] = {
      {"float32", DType::kFloat32}, {"fp32", DType::kFloat32},   {"f32", DType::kFloat32},
      {"float16", DType::kFloat16}, {"fp16", DType::kFloat16},   {"half", DType::kFloat16},
      {"bfloat16", DType::kBFloat16}, {"bf16", DType::kBFloat16}, {"float64", DType::kFloat64},
      {"fp64", DType::kFloat64},    {"int64", DType::kInt64},    {"int32", DType::kInt32},
      {"int16", DType::kInt16},     {"int8", DType::kInt8},      {"uint8", DType::kUInt8},
      {"bool", DType::kBool},
  };
  for (const auto& a : kAliases)
    if (a.name == name) return a.dtype;
  throw_arg_error("dtype_from_name", "name",
                  fmt::format("must name a supported dtype (float32/fp32, float16/fp16, "
                              "bfloat16/bf16, float64, int64, int32, int16, int8, uint8, bool); "
                              "got '{}'",
                              name));
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat64;
}

const char* device_name(DeviceType type) { return type == DeviceType::kCPU ? "cpu" : "cuda"; }

// ---------------------------------------------------------------- tensor views

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  if (shape_.size() > static_cast<size_t>(kMaxDims))
    throw_arg_error("Tensor", "shape", fmt::format("must have at most {} dims", kMaxDims));
  ndim = static_cast<int>(shape_.size());
  int i = 0;
  for (int64_t s : shape_) shape[i++] = s;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
}

Tensor Tensor::contiguous(void* data, DType dtype, const int64_t* shape, int ndim, Device device) {
  if (ndim < 0 || ndim > kMaxDims)
    throw_arg_error("Tensor::contiguous", "ndim", fmt::format("must be in [0, {}] (got {})", kMaxDims, ndim));
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.device = device;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  return t;
}

Tensor Tensor::from_dlpack(const DLTensor& dl, std::string_view arg) {
  constexpr std::string_view where = "from_dlpack";
  if (dl.ndim < 0 || dl.ndim > kMaxDims)
    throw_arg_error(where, arg, fmt::format("must have at most {} dims (got {})", kMaxDims, dl.ndim));
  if (dl.dtype.lanes != 1)
    throw_arg_error(where, arg, fmt::format("must have 1 lane per element (got {})", dl.dtype.lanes));
  DType dtype;
  const int bits = dl.dtype.bits;
  switch (dl.dtype.code) {
    case kDLFloat:
      if (bits == 32) dtype = DType::kFloat32;
      else if (bits == 16) dtype = DType::kFloat16;
      else if (bits == 64) dtype = DType::kFloat64;
      else throw_arg_error(where, arg, fmt::format("has unsupported float width {} bits", bits));
      break;
    case kDLBfloat:
      if (bits != 16) throw_arg_error(where, arg, fmt::format("has unsupported bfloat width {} bits", bits));
      dtype = DType::kBFloat16;
      break;
    case kDLInt:
      if (bits == 64) dtype = DType::kInt64;
      else if (bits == 32) dtype = DType::kInt32;
      else if (bits == 16) dtype = DType::kInt16;
      else if (bits == 8) dtype = DType::kInt8;
      else throw_arg_error(where, arg, fmt::format("has unsupported int width {} bits", bits));
      break;
    case kDLUInt:
      // DLPack < 1.0 exports bool as uint8 (some producers) or as kDLBool (code 6).
      if (bits == 8) dtype = DType::kUInt8;
      else throw_arg_error(where, arg, fmt::format("has unsupported uint width {} bits", bits));
      break;
    case 6:  // kDLBool in DLPack >= 0.8
      if (bits != 8) throw_arg_error(where, arg, fmt::format("has unsupported bool width {} bits", bits));
      dtype = DType::kBool;
      break;
    default:
      throw_arg_error(where, arg, fmt::format("has unsupported DLPack dtype code {}", dl.dtype.code));
  }
  Device device;
  switch (dl.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      device.type = DeviceType::kCPU;
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      device.type = DeviceType::kCUDA;
      break;
    default:
      throw_arg_error(where, arg, fmt::format("lives on unsupported DLPack device type {}",
                                              static_cast<int>(dl.device.device_type)));
  }
  device.index = dl.device.device_id;
  Tensor t;
  t.dtype = dtype;
  t.device = device;
  t.ndim = dl.ndim;
  t.data = dl.data == nullptr ? nullptr : static_cast<char*>(dl.data) + dl.byte_offset;
  int64_t stride = 1;
  for (int d = dl.ndim - 1; d >= 0; --d) {
    t.shape[d] = dl.shape[d];
    t.strides[d] = dl.strides ? dl.strides[d] : stride;
    stride *= dl.shape[d];
  }
  check_tensor(t, where, arg);
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

int64_t Tensor::size(int dim) const {
  const int d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim)
    throw_arg_error("Tensor::size", "dim", fmt::format("must be in [{}, {}) (got {})", -ndim, ndim, dim));
  return shape[d];
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

bool Tensor::may_self_overlap() const {
  if (numel() <= 1 || is_contiguous()) return false;
  // Dims of size > 1 by increasing |stride|: no overlap is proved when each
  // stride exceeds the furthest offset the smaller dims reach.
  std::array<std::pair<int64_t, int64_t>, kMaxDims> dims{};  // (|stride|, size)
  int n = 0;
  for (int d = 0; d < ndim; ++d)
    if (shape[d] > 1) dims[n++] = {strides[d] < 0 ? -strides[d] : strides[d], shape[d]};
  for (int k = 1; k < n; ++k)  // insertion sort: at most kMaxDims entries
    for (int j = k; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  int64_t reach = 0;  // the largest offset reachable with the dims so far
  for (int k = 0; k < n; ++k) {
    if (dims[k].first <= reach) return true;  // also catches stride 0
    reach += dims[k].first * (dims[k].second - 1);
  }
  return false;
}

uintptr_t Tensor::byte_begin() const {
  if (numel() == 0) return reinterpret_cast<uintptr_t>(data);
  int64_t lo = 0;
  for (int d = 0; d < ndim; ++d)
    if (strides[d] < 0) lo += strides[d] * (shape[d] - 1);
  return reinterpret_cast<uintptr_t>(data) + lo * static_cast<int64_t>(element_size());
}

uintptr_t Tensor::byte_end() const {
  if (numel() == 0) return reinterpret_cast<uintptr_t>(data);
  int64_t hi = 0;
  for (int d = 0; d < ndim; ++d)
    if (strides[d] > 0) hi += strides[d] * (shape[d] - 1);
  return reinterpret_cast<uintptr_t>(data) + (hi + 1) * static_cast<int64_t>(element_size());
}

Tensor Tensor::reshaped(std::initializer_list<int64_t> new_shape) const {
  if (!is_contiguous()) throw_arg_error("Tensor::reshaped", "self", "must be contiguous to reshape");
  Tensor t(data, dtype, new_shape, device);
  if (t.numel() != numel())
    throw_arg_error("Tensor::reshaped", "new_shape",
                    fmt::format("must keep numel {} (got {})", numel(), t.numel()));
  return t;
}

std::string Tensor::describe() const {
  std::string s = fmt::format("{}[", dtype_name(dtype));
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  s += fmt::format("] {}", device_name(device.type));
  return s;
}

void check_tensor(const Tensor& t, std::string_view where, std::string_view arg) {
  if (t.ndim < 0 || t.ndim > kMaxDims)
    throw_arg_error(where, arg, fmt::format("must have 0..{} dims (got {})", kMaxDims, t.ndim));
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] < 0)
      throw_arg_error(where, arg, fmt::format("must have non-negative sizes (dim {} is {})", d, t.shape[d]));
  if (t.data == nullptr && t.numel() > 0)
    throw_arg_error(where, arg, fmt::format("has null data but {} elements", t.numel()));
}

void check_dtype(const Tensor& t, std::initializer_list<DType> allowed, std::string_view where,
                 std::string_view arg) {
  for (DType d : allowed)
    if (d == t.dtype) return;
  // The message only on failure: this check runs on every call of every op.
  std::string names;
  for (DType d : allowed) names += names.empty() ? dtype_name(d) : fmt::format(", {}", dtype_name(d));
  throw_arg_error(where, arg, fmt::format("must have dtype in {{{}}} (got {})", names, dtype_name(t.dtype)));
}

void check_cpu(const Tensor& t, std::string_view where, std::string_view arg) {
  if (t.device.type != DeviceType::kCPU)
    throw_arg_error(where, arg,
                    fmt::format("lives on {} but this build has only the CPU backend",
                                device_name(t.device.type)));
}

void check_no_self_overlap(const Tensor& t, std::string_view where, std::string_view arg) {
  if (t.may_self_overlap())
    throw_arg_error(where, arg,
                    fmt::format("must not overlap itself, since this op writes it in place (got {} with strides [{}]: "
                                "one element is reached by several indices, as after expand()); pass a view "
                                "without self-overlap, e.g. clone() it",
                                t.describe(), fmt::join(t.strides, t.strides + t.ndim, ", ")));
}

// ---------------------------------------------------------------- scalar conversions

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((abs >> 13) & 0x3FFu);  // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {                        // normal half
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
  }
  if (abs < 0x33000000u) return sign;  // < 2^-25: rounds to zero
  // subnormal half: value = mant * 2^-24
  const uint32_t e = abs >> 23;
  const uint32_t m = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24
  const uint32_t half_bits = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  uint32_t r = half_bits;
  if (rem > halfway || (rem == halfway && (half_bits & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

double load_as_double(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat64: return static_cast<const double*>(data)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DType::kInt32: return static_cast<const int32_t*>(data)[i];
    case DType::kInt16: return static_cast<const int16_t*>(data)[i];
    case DType::kInt8: return static_cast<const int8_t*>(data)[i];
    case DType::kUInt8: return static_cast<const uint8_t*>(data)[i];
    case DType::kBool: return static_cast<const uint8_t*>(data)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

void store_from_double(void* data, DType dtype, int64_t i, double v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = static_cast<float>(v); return;
    // Via float: double -> float -> half can double-round, but only for values that are
    // not representable in float to begin with; callers compute in float anyway.
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_half(static_cast<float>(v)); return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(v)); return;
    case DType::kFloat64: static_cast<double*>(data)[i] = v; return;
    case DType::kInt64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); return;
    case DType::kInt32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); return;
    case DType::kInt16: static_cast<int16_t*>(data)[i] = static_cast<int16_t>(v); return;
    case DType::kInt8: static_cast<int8_t*>(data)[i] = static_cast<int8_t>(v); return;
    case DType::kUInt8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); return;
    case DType::kBool: static_cast<uint8_t*>(data)[i] = v != 0.0; return;
  }
}

// ---------------------------------------------------------------- counters

namespace {
std::atomic<uint64_t> g_dispatches{0};
std::atomic<uint64_t> g_host_reads{0};
}  // namespace

Counters counters() { return {g_dispatches.load(), g_host_reads.load()}; }
void reset_counters() {
  g_dispatches = 0;
  g_host_reads = 0;
}
void count_dispatch() { g_dispatches.fetch_add(1, std::memory_order_relaxed); }
void count_host_read() { g_host_reads.fetch_add(1, std::memory_order_relaxed); }

double read_scalar(const Tensor& scalar) {
  check_tensor(scalar, "read_scalar", "scalar");
  check_cpu(scalar, "read_scalar", "scalar");
  if (scalar.numel() != 1)
    throw_arg_error("read_scalar", "scalar", fmt::format("must have exactly 1 element (got {})", scalar.numel()));
  count_host_read();
  return load_as_double(scalar.data, scalar.dtype, 0);
}

// ---------------------------------------------------------------- threads

namespace {
// Set in the child of a fork(): GNU OpenMP's worker pool belongs to the parent
// and a parallel region in the child waits for threads that do not exist.
std::atomic<bool> g_forked_child{false};
[[maybe_unused]] const bool g_fork_handler_installed = [] {
  return pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true, std::memory_order_relaxed); }) == 0;
}();
}  // namespace

bool detail::parallel_allowed() { return !g_forked_child.load(std::memory_order_relaxed); }

int num_threads() { return detail::parallel_allowed() ? omp_get_max_threads() : 1; }
void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads)
    throw_arg_error("set_num_threads", "n", fmt::format("must be in [1, {}] (got {})", kMaxThreads, n));
  omp_set_num_threads(n);
}

}  // namespace leanstep
