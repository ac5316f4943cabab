// Compiled AutocastCPU kernels for the emulation (precision_audit/emulation/compiled.py builds and loads this).
//
// They do exactly what the Python kernels in emulation.py do for three policies, op for op, so the results
// are bit-identical (tests/capture/test_compiled_kernels.py checks it, forward and backward):
//
//   gemm     (lower precision, computed in fp32): every eligible tensor argument is rounded to the autocast
//            dtype and handed on as float32 (x.to(dtype).float(), or x.float() when it already has that dtype);
//            the op runs with AutocastCPU excluded; float32 outputs are rounded to the autocast dtype. Where
//            CUDA adds the bias in a second kernel (a convolution cuDNN runs; linear on a non-contiguous input)
//            the op runs without it and the bias is added afterwards, rounded again (emulation._without_bias).
//   fp32     every eligible tensor argument is cast to float32; the op runs with AutocastCPU excluded.
//   fp32_set_opt_dtype
//            when the first argument is eligible and the op's `dtype` argument is None, it becomes float32.
//
// "Eligible" is CUDA autocast's rule: a defined floating-point tensor, not float64, on the autocast device.
// What they save is the Python round trip per call (about 20-40 us on a 2-core CPU), which dominates small
// models. Every cast goes through the dispatcher from the Autocast key, above autograd, so autograd records
// the same nodes as for the Python kernels.
//
// Only the dispatcher and ATen headers are used, and the control ops are registered as torch ops
// (torch.ops.precision_audit_emu.*), so the library needs no Python headers and builds in well under a minute.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using c10::IValue;

std::unique_ptr<torch::Library> g_lib;

// Rounded copies made while a memory measurement runs (rounding.py's rounding registry): the fp32 tensor
// that holds low-precision values, its itemsize on a GPU, and whether it was made from a parameter.
bool g_recording = false;
std::vector<std::tuple<at::Tensor, int64_t, bool>> g_records;

bool eligible(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble && t.device().is_cpu();
}

at::Tensor round_up(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor out;
  if (t.defined() && t.scalar_type() == dtype) {
    out = t.to(at::kFloat);
  } else if (eligible(t)) {
    out = t.to(dtype).to(at::kFloat);
  } else {
    return t;
  }
  if (g_recording) {
    const int64_t itemsize = (dtype == at::kHalf || dtype == at::kBFloat16) ? 2 : 4;
    g_records.emplace_back(out, itemsize, t.is_leaf() && t.requires_grad());
  }
  return out;
}

at::Tensor to_fp32(const at::Tensor& t) {
  return eligible(t) ? t.to(at::kFloat) : t;
}

template <typename F>
IValue map_tensors(IValue v, F&& f) {
  if (v.isTensor()) {
    return IValue(f(v.toTensor()));
  }
  if (v.isTensorList()) {
    auto list = v.toTensorList();
    c10::List<at::Tensor> out;
    out.reserve(list.size());
    for (const at::Tensor& t : list) {
      out.push_back(f(t));
    }
    return IValue(std::move(out));
  }
  if (v.isOptionalTensorList()) {
    auto list = v.toOptionalTensorList();
    c10::List<std::optional<at::Tensor>> out;
    out.reserve(list.size());
    for (std::optional<at::Tensor> t : list) {
      out.push_back(t.has_value() ? std::optional<at::Tensor>(f(*t)) : std::nullopt);
    }
    return IValue(std::move(out));
  }
  return v;
}

template <typename F>
void map_arguments(const c10::OperatorHandle& op, torch::jit::Stack* stack, F&& f) {
  const size_t n = op.schema().arguments().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
    *it = map_tensors(std::move(*it), f);
  }
}

void call_without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  op.callBoxed(stack);
}

// The argument named `name`: its position in the schema (or -1) and its value on the stack.
const IValue* find_arg(const c10::FunctionSchema& schema, torch::jit::Stack::iterator first, const char* name,
                       int64_t* index) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == name) {
      *index = static_cast<int64_t>(i);
      return &*(first + static_cast<std::ptrdiff_t>(i));
    }
  }
  *index = -1;
  return nullptr;
}

bool is_conv_op(const c10::FunctionSchema& schema) {
  const std::string& n = schema.name();
  return n == "aten::conv1d" || n == "aten::conv2d" || n == "aten::conv3d" || n == "aten::conv_transpose1d" ||
         n == "aten::conv_transpose2d" || n == "aten::conv_transpose3d" || n == "aten::convolution" ||
         n == "aten::_convolution";
}

// emulation._cudnn_adds_bias: cuDNN (bias added afterwards) unless disabled or the convolution is depthwise.
bool cudnn_adds_bias(const c10::FunctionSchema& schema, torch::jit::Stack::iterator first) {
  int64_t i = -1;
  const IValue* enabled = find_arg(schema, first, "cudnn_enabled", &i);
  if (!(enabled ? enabled->toBool() : at::globalContext().userEnabledCuDNN())) {
    return false;
  }
  const IValue* transposed_v = find_arg(schema, first, "transposed", &i);
  const bool transposed = transposed_v ? transposed_v->toBool()
                                       : schema.name().rfind("aten::conv_transpose", 0) == 0;
  const IValue* groups_v = find_arg(schema, first, "groups", &i);
  const int64_t groups = groups_v ? groups_v->toInt() : 1;
  const at::Tensor& x = first->toTensor();
  const at::Tensor& w = (first + 1)->toTensor();
  const bool depthwise = !transposed && groups > 1 && x.dim() >= 3 && x.dim() <= 5 && x.size(1) == groups &&
                         w.size(0) % x.size(1) == 0;
  return !depthwise;
}

// emulation._linear_adds_bias: at::linear falls back to matmul + add.
bool linear_adds_bias(const at::Tensor& x, const at::Tensor& bias) {
  if (x.dim() == 2) {
    return false;
  }
  const bool fusable = (bias.dim() == 1 || bias.squeeze().dim() == 1) && bias.is_contiguous();
  return !(fusable && x.is_contiguous());
}

void gemm_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
  map_arguments(op, stack, [dtype](const at::Tensor& t) { return round_up(t, dtype); });
  const auto& schema = op.schema();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(schema.arguments().size());
  at::Tensor bias;
  bool conv = false;
  int64_t bias_index = -1;
  const IValue* bias_v = find_arg(schema, first, "bias", &bias_index);
  if (bias_v && bias_v->isTensor() && bias_v->toTensor().defined() &&
      bias_v->toTensor().scalar_type() != at::kDouble && first->isTensor() &&
      first->toTensor().scalar_type() != at::kDouble) {  // fp64 is not autocast's: the op runs as called
    conv = is_conv_op(schema);
    if (conv ? cudnn_adds_bias(schema, first)
             : schema.name() == "aten::linear" && linear_adds_bias(first->toTensor(), bias_v->toTensor())) {
      bias = bias_v->toTensor();
      *(first + static_cast<std::ptrdiff_t>(bias_index)) = IValue();
    }
  }
  call_without_autocast(op, stack);
  const size_t n = schema.returns().size();
  auto round_out = [dtype](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kFloat ? t.to(dtype) : t;
  };
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
    *it = map_tensors(std::move(*it), round_out);
  }
  if (bias.defined()) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    at::Tensor out = stack->back().toTensor();
    if (conv) {
      std::vector<int64_t> shape(static_cast<size_t>(out.dim()), 1);
      shape[1] = -1;
      bias = bias.reshape(shape);
    }
    stack->back() = IValue((out.to(at::kFloat) + bias).to(dtype));
  }
}

void fp32_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  map_arguments(op, stack, to_fp32);
  call_without_autocast(op, stack);
}

void fp32_set_opt_dtype_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  if (n > 0 && first->isTensor() && eligible(first->toTensor())) {
    for (size_t i = 0; i < n; ++i) {
      if (args[i].name() == "dtype") {
        if ((first + static_cast<std::ptrdiff_t>(i))->isNone()) {
          *(first + static_cast<std::ptrdiff_t>(i)) = IValue(at::kFloat);
        }
        break;
      }
    }
  }
  call_without_autocast(op, stack);
}

// Registers the kernels on AutocastCPU for the named aten ops ("linear", "conv_transpose2d.input", ...),
// replacing whatever was there; disable() removes them all, which restores torch's own CPU kernels.
void enable(const std::vector<std::string>& gemm, const std::vector<std::string>& fp32,
            const std::vector<std::string>& fp32_set_opt_dtype) {
  TORCH_CHECK(!g_lib, "precision_audit_emu: kernels are already enabled");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              std::make_optional(c10::DispatchKey::AutocastCPU), __FILE__,
                                              __LINE__);
  for (const auto& name : gemm) {
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&gemm_kernel>());
  }
  for (const auto& name : fp32) {
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fp32_kernel>());
  }
  for (const auto& name : fp32_set_opt_dtype) {
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fp32_set_opt_dtype_kernel>());
  }
  g_lib = std::move(lib);
}

void enable_op(c10::List<std::string> gemm, c10::List<std::string> fp32, c10::List<std::string> fp32_set_opt_dtype) {
  enable(gemm.vec(), fp32.vec(), fp32_set_opt_dtype.vec());
}

void disable() {
  g_lib.reset();
}

void set_recording(bool on) {
  g_recording = on;
  if (!on) {
    g_records.clear();
  }
}

// The records since the last call, handed over (and forgotten here).
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, c10::List<bool>> drain() {
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> itemsizes;
  c10::List<bool> from_parameter;
  for (auto& [t, size, param] : g_records) {
    tensors.push_back(t);
    itemsizes.push_back(size);
    from_parameter.push_back(param);
  }
  g_records.clear();
  return {tensors, itemsizes, from_parameter};
}


// ---- Fused tensor statistics (capture/stats.py calls these; docs/performance.md, "Statistics: one read ...") ----
//
// range_stats: one read of x for everything MagnitudeHistogram / RangeSummary keep: the bucket counts of |x|
// against the sorted float32 edges (bucket i holds edge[i-1] <= |x| < edge[i], i.e. torch.bucketize(right=True);
// zeros are not in any bucket), zeros, NaNs, infs and the largest finite |x|. Every value is first rounded to
// float32, as the Python path does (exact for fp16/bf16). With an undefined `edges` the buckets are skipped.
// Returns (counts[len(edges) + 1] int64, [zeros, nans, infs] int64, amax).
//
// error_sums: one read of ref and p for ErrorStats: per element in double (exact products of float32 values,
// double accumulation, as the Python path's float64 copies), elements whose reference is not finite left out.
// Returns ([ref_nonfinite, nonfinite] int64, [sum_ref2, sum_diff2, sum_dot, sum_p2, max_abs] float64).

// float32 <-> its bits (memcpy: the defined way to reinterpret; compiles to a register move).
inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Vectorized clones: the statistics' per-element loops are compiled for AVX-512 and AVX2 besides the baseline
// x86-64 (SSE2), and the loader picks the widest the CPU has (GCC's target_clones, an ifunc). The build flags stay
// portable (a cached library may be loaded on another machine of a cluster); the clones are the same source, and
// every result is the same bits in each (integer counts and maxima; the sums keep their lanes and order, and
// -ffp-contract=off keeps fused multiply-adds out of every clone). Elsewhere (clang, other CPUs): one version.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define PA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PA_CLONES
#endif
#define PA_INLINE inline __attribute__((always_inline))

// The bucket of a finite |x| > 0 from its float32 bits, without a search. Positive floats order as their bits, so
// the cell `bits >> 19` (the exponent and the top four mantissa bits) fixes the bucket up to the edges strictly
// inside the cell; every cell of a normal binade holds at most two of them here (the FP16 maximum 65504 and its
// overflow threshold 65520, at every loss scale, share a cell), so
//     bucket = base + (low >= t1) + (low >= t2),   low = bits & 0x7FFFF,
// with an absent edge's threshold 0x80000, above every `low`. Two 32-bit words per cell (base | t1 << 12, and t2:
// two gathers in a vector loop). Cells of exponent 0 (zero and the subnormals) map to the extra bucket `sub`,
// which the pass resolves afterwards (zeros are counted apart; a subnormal, rare in any model, by a binary
// search); inf and NaN to `special`. An edge list with more edges in a cell (or more than 4093 edges) takes the
// binary search for every value.
struct CellTable {
  static constexpr int kShift = 19;
  static constexpr uint32_t kLow = (1u << kShift) - 1, kNone = 1u << kShift, kInf = 0x7f800000u;
  static constexpr uint32_t kCells = (kInf >> kShift) + 1;
  static constexpr int64_t kMaxBase = (1 << 12) - 1;
  static constexpr int kMaxLows = 7;
  bool fast = false, planes = false;
  int64_t n = 0, sub = 0, special = 0;  // edges; the two extra buckets
  std::vector<float> edges;
  std::vector<uint32_t> base_t1, t2;
  std::vector<uint32_t> lows;          // the plane layout (bucket_planes_avx512)
  std::vector<uint16_t> plane_bucket;  // [s << 12 | cell] -> bucket

  explicit CellTable(const float* e, int64_t size) : n(size), sub(size + 1), special(size + 2), edges(e, e + size) {
    build_planes();
    if (size + 2 > kMaxBase) return;  // the base must fit its 12 bits
    base_t1.assign(kCells, 0);
    t2.assign(kCells, kNone);
    for (uint32_t c = 0; c < kCells; ++c) {
      const uint32_t lo = c << kShift;
      if ((lo >> 23) == 0) {
        base_t1[c] = pack(sub, kNone);
        continue;
      }
      if (lo >= kInf) {
        base_t1[c] = pack(special, kNone);
        continue;
      }
      const float* p = std::upper_bound(edges.data(), edges.data() + n, float_of(lo));
      const uint32_t base = static_cast<uint32_t>(p - edges.data());
      uint32_t t[2] = {kNone, kNone};
      int k = 0;
      for (; p < edges.data() + n && bits_of(*p) < lo + kNone; ++p, ++k) {
        if (k == 2) return;  // three edges in one cell: not this table's case
        t[k] = bits_of(*p) & kLow;
      }
      base_t1[c] = pack(base, t[0]);
      t2[c] = t[1];
    }
    fast = true;
  }

  static uint32_t pack(uint32_t base, uint32_t t1) { return base | t1 << 12; }

  // The plane layout, for a loop with no table lookup per element: the distinct `low` bits of the edges strictly
  // inside normal cells (the audit's edges have four: 65504 and 65520 at every loss scale, bf16's largest value and
  // its overflow threshold, and the thresholds one bit above a power of two). An element's bin is its cell and its
  // plane s = #{lows <= low}; every edge inside a cell is at one of the lows, so a bin lies between two
  // consecutive edges and maps to one bucket, found once here.
  void build_planes() {
    std::vector<uint32_t> l;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = bits_of(edges[i]);
      if ((b >> 23) != 0 && b < kInf && (b & kLow) != 0) l.push_back(b & kLow);
    }
    std::sort(l.begin(), l.end());
    l.erase(std::unique(l.begin(), l.end()), l.end());
    if (static_cast<int64_t>(l.size()) > kMaxLows || n + 2 > 0xFFFF) return;
    lows = l;
    plane_bucket.assign(static_cast<size_t>(kMaxLows + 1) << 12, 0);
    for (uint32_t c = 1u << 4; c < (kInf >> kShift); ++c) {  // the normal cells
      for (size_t p = 0; p <= lows.size(); ++p) {
        const uint32_t first = c << kShift | (p ? lows[p - 1] : 0u);
        plane_bucket[p << 12 | c] = static_cast<uint16_t>(search(float_of(first)));
      }
    }
    planes = true;
  }

  int64_t search(float a) const { return std::upper_bound(edges.data(), edges.data() + n, a) - edges.data(); }
};

// One table per thread, rebuilt when the edges differ from the last call's (they are the same tensor every call).
const CellTable& cell_table(const float* e, int64_t size) {
  thread_local std::unique_ptr<CellTable> table;
  if (!table || table->n != size || !std::equal(e, e + size, table->edges.data())) {
    table = std::make_unique<CellTable>(e, size);
  }
  return *table;
}

// Element to float32, exactly as static_cast<float> does, in forms the vectorizer takes: bf16 is its bits shifted
// up; IEEE half is c10::detail::fp16_ieee_to_fp32_value's portable arithmetic with a mask instead of the branch
// GCC makes of its ternary (the same bits for all 65536 values: tests/capture/test_fused_stats.py).
PA_INLINE float to_float(float v) { return v; }
PA_INLINE float to_float(double v) { return static_cast<float>(v); }
PA_INLINE float to_float(c10::BFloat16 v) { return float_of(static_cast<uint32_t>(v.x) << 16); }
PA_INLINE float to_float(c10::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t two_w = w + w;
  const float normal = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t sub = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones for a subnormal or zero
  return float_of((w & 0x80000000u) | (bits_of(subnormal) & sub) | (bits_of(normal) & ~sub));
}
// ... and to double (exact from any of them).
template <typename T>
PA_INLINE double to_double(T v) {
  return static_cast<double>(to_float(v));
}
PA_INLINE double to_double(double v) { return v; }

PA_INLINE uint32_t abs_bits(float v) { return bits_of(v) & 0x7fffffffu; }

// Zeros, NaNs, infs, subnormals and the largest finite |x| of a block (32-bit counts: a block is small).
struct BlockCounts {
  int32_t zeros = 0, nans = 0, infs = 0, subs = 0;
  float amax = 0.0f;
};

// The totals of a piece of the tensor.
struct ChunkCounts {
  int64_t zeros = 0, nans = 0, infs = 0;
  float amax = 0.0f;
  void add(const BlockCounts& b) {
    zeros += b.zeros;
    nans += b.nans;
    infs += b.infs;
    amax = std::max(amax, b.amax);
  }
};

// One vectorized loop over a block: the bucket of every element (into idx; the two extra buckets for zeros and
// subnormals, and for inf and NaN) and the block's counts (exact in any order). The sign is cleared on the bits,
// not by std::fabs, which keeps GCC from vectorizing the loop.
template <typename T>
PA_INLINE void bucket_block_impl(const T* x, int64_t n, const uint32_t* base_t1, const uint32_t* t2, uint16_t* idx,
                                 BlockCounts* out) {
  int32_t zeros = 0, nans = 0, infs = 0, subs = 0;
  float amax = 0.0f;
#pragma omp simd reduction(+ : zeros, nans, infs, subs) reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = abs_bits(to_float(x[i]));
    const uint32_t c = (bits < CellTable::kInf ? bits : CellTable::kInf) >> CellTable::kShift;
    const uint32_t w = base_t1[c], low = bits & CellTable::kLow;
    idx[i] = static_cast<uint16_t>((w & 0xFFFu) + (low >= (w >> 12)) + (low >= t2[c]));
    zeros += bits == 0;
    infs += bits == CellTable::kInf;
    nans += bits > CellTable::kInf;
    subs += (bits - 1u) < 0x007FFFFFu;  // 0 < bits < 0x00800000
    const float f = bits < CellTable::kInf ? float_of(bits) : 0.0f;
    amax = f > amax ? f : amax;
  }
  *out = {zeros, nans, infs, subs, amax};
}

// The same counts without buckets (RangeSummary).
template <typename T>
PA_INLINE void range_block_impl(const T* x, int64_t n, BlockCounts* out) {
  int32_t zeros = 0, nans = 0, infs = 0;
  float amax = 0.0f;
#pragma omp simd reduction(+ : zeros, nans, infs) reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = abs_bits(to_float(x[i]));
    zeros += bits == 0;
    infs += bits == CellTable::kInf;
    nans += bits > CellTable::kInf;
    const float f = bits < CellTable::kInf ? float_of(bits) : 0.0f;
    amax = f > amax ? f : amax;
  }
  *out = {zeros, nans, infs, 0, amax};
}

#define PA_BLOCK_KERNELS(T)                                                                                      \
  PA_CLONES void bucket_block(const T* x, int64_t n, const uint32_t* base_t1, const uint32_t* t2, uint16_t* idx, \
                              BlockCounts* out) {                                                                \
    bucket_block_impl(x, n, base_t1, t2, idx, out);                                                              \
  }                                                                                                              \
  PA_CLONES void range_block(const T* x, int64_t n, BlockCounts* out) { range_block_impl(x, n, out); }
PA_BLOCK_KERNELS(float)
PA_BLOCK_KERNELS(double)
PA_BLOCK_KERNELS(c10::Half)
PA_BLOCK_KERNELS(c10::BFloat16)

// Elements to float32 (a vectorized copy), for the AVX-512 bucket loop below, which reads float32.
template <typename T>
PA_INLINE void float_block_impl(const T* x, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]);
}
#define PA_FLOAT_BLOCK(T) \
  PA_CLONES void float_block(const T* x, int64_t n, float* out) { float_block_impl(x, n, out); }
PA_FLOAT_BLOCK(double)
PA_FLOAT_BLOCK(c10::Half)
PA_FLOAT_BLOCK(c10::BFloat16)

PA_INLINE const float* as_floats(const float* x, int64_t, float*) { return x; }
template <typename T>
PA_INLINE const float* as_floats(const T* x, int64_t n, float* buf) {
  float_block(x, n, buf);
  return buf;
}

#if defined(__GNUC__) && defined(__x86_64__)
#define PA_AVX512_BUCKETS 1
// The plane layout's bins (CellTable::build_planes), 16 elements at a time with no table lookup: bin = s << 12 |
// cell for a normal finite |x|, bin 0 (a subnormal cell, never read) for the rest, whose counts come from the
// bits; the smallest and largest normal cell (the bins to read back) and the block's counts. (The bucket_block
// loop above with its two gathers ran at 1.5 ns per element on a CPU where gathers are slow, this one at ~0.1.)
PA_INLINE uint32_t plane_bin(uint32_t bits, const uint32_t* lows, int k) {
  if (bits < (1u << 23) || bits >= CellTable::kInf) return 0;
  const uint32_t low = bits & CellTable::kLow;
  uint32_t s = 0;
  for (int j = 0; j < k; ++j) s += low >= lows[j];
  return s << 12 | bits >> CellTable::kShift;
}

__attribute__((target("avx512f"))) void plane_block_avx512(const float* x, int64_t n, const uint32_t* lows, int k,
                                                           uint16_t* idx, BlockCounts* out, uint32_t* cmin,
                                                           uint32_t* cmax) {
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(static_cast<int>(CellTable::kInf));
  const __m512i low_mask = _mm512_set1_epi32(CellTable::kLow), min_normal = _mm512_set1_epi32(1 << 23);
  const __m512i sub_end = _mm512_set1_epi32(0x007FFFFF);
  __m512i lv[CellTable::kMaxLows];
  for (int j = 0; j < k; ++j) lv[j] = _mm512_set1_epi32(static_cast<int>(lows[j]));
  __m512i zeros = zero, nans = zero, infs = zero, subs = zero, amax = zero;
  __m512i lo_c = _mm512_set1_epi32(-1), hi_c = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask);
    const __m512i low = _mm512_and_si512(bits, low_mask);
    __m512i s = zero;
    for (int j = 0; j < k; ++j) s = _mm512_mask_add_epi32(s, _mm512_cmpge_epu32_mask(low, lv[j]), s, one);
    const __m512i c = _mm512_srli_epi32(bits, CellTable::kShift);
    const __mmask16 finite = _mm512_cmplt_epu32_mask(bits, inf);
    const __mmask16 normal = finite & _mm512_cmpge_epu32_mask(bits, min_normal);
    const __m512i bin = _mm512_maskz_or_epi32(normal, _mm512_slli_epi32(s, 12), c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + i), _mm512_cvtepi32_epi16(bin));
    lo_c = _mm512_mask_min_epu32(lo_c, normal, lo_c, c);
    hi_c = _mm512_mask_max_epu32(hi_c, normal, hi_c, c);
    zeros = _mm512_mask_add_epi32(zeros, _mm512_cmpeq_epi32_mask(bits, zero), zeros, one);
    infs = _mm512_mask_add_epi32(infs, _mm512_cmpeq_epi32_mask(bits, inf), infs, one);
    nans = _mm512_mask_add_epi32(nans, _mm512_cmpgt_epu32_mask(bits, inf), nans, one);
    subs = _mm512_mask_add_epi32(subs, _mm512_cmplt_epu32_mask(_mm512_sub_epi32(bits, one), sub_end), subs, one);
    amax = _mm512_mask_max_epu32(amax, finite, amax, bits);
  }
  uint32_t lo = static_cast<uint32_t>(_mm512_reduce_min_epu32(lo_c)), hi = static_cast<uint32_t>(_mm512_reduce_max_epu32(hi_c));
  int32_t t_zeros = 0, t_nans = 0, t_infs = 0, t_subs = 0;
  uint32_t t_amax = 0;
  for (; i < n; ++i) {
    const uint32_t bits = abs_bits(x[i]);
    const uint32_t bin = plane_bin(bits, lows, k);
    idx[i] = static_cast<uint16_t>(bin);
    if (bin) {
      lo = std::min(lo, bits >> CellTable::kShift);
      hi = std::max(hi, bits >> CellTable::kShift);
    }
    t_zeros += bits == 0;
    t_infs += bits == CellTable::kInf;
    t_nans += bits > CellTable::kInf;
    t_subs += (bits - 1u) < 0x007FFFFFu;
    if (bits < CellTable::kInf) t_amax = std::max(t_amax, bits);
  }
  out->zeros = _mm512_reduce_add_epi32(zeros) + t_zeros;
  out->nans = _mm512_reduce_add_epi32(nans) + t_nans;
  out->infs = _mm512_reduce_add_epi32(infs) + t_infs;
  out->subs = _mm512_reduce_add_epi32(subs) + t_subs;
  out->amax = float_of(std::max(static_cast<uint32_t>(_mm512_reduce_max_epu32(amax)), t_amax));
  *cmin = std::min(*cmin, lo);
  *cmax = std::max(*cmax, hi);
}

// False: the portable loops even on a CPU with AVX-512 (set_avx512: the tests run both on one machine).
bool g_allow_avx512 = true;

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes && g_allow_avx512;
}
#else
bool g_allow_avx512 = false;
bool have_avx512() { return false; }
#endif

// Turns the AVX-512 loops off (or back on, where the CPU has them); returns whether they were on.
bool set_avx512(bool on) {
  const bool was = have_avx512();
  g_allow_avx512 = on;
  return was;
}

// Elements per block: its bucket indices (uint16) stay in L1 between the vectorized loop and the counting.
constexpr int64_t kBlock = 4096;
// Elements per piece at least: a piece is one thread's contiguous share; smaller tensors run on one thread.
constexpr int64_t kMinPiece = 16384;

// The subnormals of x[lo:hi] (in no bin of either layout), each found by a binary search.
template <typename T>
void subnormal_buckets(const T* x, int64_t lo, int64_t hi, const CellTable& table, std::vector<int64_t>& out) {
  for (int64_t j = lo; j < hi; ++j) {
    const float a = float_of(abs_bits(to_float(x[j])));
    const uint32_t bits = bits_of(a);
    if (bits != 0 && bits < 0x00800000u) ++out[table.search(a)];
  }
}

#ifdef PA_AVX512_BUCKETS
// The plane layout's four interleaved sub-histograms of 32-bit counts, one set per thread for the process (32768
// bins each; only the bins a tensor touches are read back and cleared, so a small tensor pays for its own range).
struct PlaneLanes {
  static constexpr int64_t kBins = int64_t{CellTable::kMaxLows + 1} << 12;
  std::vector<uint32_t> lanes = std::vector<uint32_t>(4 * kBins, 0);
  uint32_t cmin = ~0u, cmax = 0;

  // Adds the touched bins into out (by plane_bucket) and clears them, and bin 0 (the elements in no bin).
  void flush(const CellTable& table, std::vector<int64_t>& out) {
    uint32_t* l = lanes.data();
    for (size_t s = 0; cmin <= cmax && s <= table.lows.size(); ++s) {
      for (uint32_t c = cmin; c <= cmax; ++c) {
        const int64_t j = static_cast<int64_t>(s << 12 | c);
        const int64_t sum = int64_t{l[j]} + l[kBins + j] + l[2 * kBins + j] + l[3 * kBins + j];
        if (sum) {
          out[table.plane_bucket[j]] += sum;
          l[j] = l[kBins + j] = l[2 * kBins + j] = l[3 * kBins + j] = 0;
        }
      }
    }
    l[0] = l[kBins] = l[2 * kBins] = l[3 * kBins] = 0;
    cmin = ~0u;
    cmax = 0;
  }
};

PlaneLanes& plane_lanes() {
  thread_local PlaneLanes pl;  // one per thread for every element type (the same bins)
  return pl;
}

template <typename T>
void piece_planes(const T* x, int64_t lo, int64_t hi, const CellTable& table, std::vector<int64_t>& out,
                  ChunkCounts& cc) {
  PlaneLanes& pl = plane_lanes();
  uint32_t* l0 = pl.lanes.data();
  uint32_t* l1 = l0 + PlaneLanes::kBins;
  uint32_t* l2 = l1 + PlaneLanes::kBins;
  uint32_t* l3 = l2 + PlaneLanes::kBins;
  const int k = static_cast<int>(table.lows.size());
  uint16_t idx[kBlock];
  float buf[kBlock];
  int64_t since_flush = 0;
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    const int64_t m = std::min(kBlock, hi - b0);
    BlockCounts bc;
    plane_block_avx512(as_floats(x + b0, m, buf), m, table.lows.data(), k, idx, &bc, &pl.cmin, &pl.cmax);
    cc.add(bc);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      ++l0[idx[i]];
      ++l1[idx[i + 1]];
      ++l2[idx[i + 2]];
      ++l3[idx[i + 3]];
    }
    for (; i < m; ++i) ++l0[idx[i]];
    if (bc.subs) subnormal_buckets(x, b0, b0 + m, table, out);
    since_flush += m;
    if (since_flush >= (int64_t{1} << 30)) {  // before a 32-bit count could wrap
      pl.flush(table, out);
      since_flush = 0;
    }
  }
  pl.flush(table, out);
}
#endif

// The buckets of x[lo:hi] into out (length table.n + 1), and its counts. Four interleaved sub-histograms of 32-bit
// counts (so that runs of equal buckets do not wait on one counter), added into out every 2^20 elements.
template <typename T>
void piece_buckets(const T* x, int64_t lo, int64_t hi, const CellTable& table, std::vector<int64_t>& out,
                   ChunkCounts& cc) {
  const int64_t nb = table.n + 1;
#ifdef PA_AVX512_BUCKETS
  if (table.planes && have_avx512()) {
    piece_planes(x, lo, hi, table, out, cc);
    return;
  }
#endif
  if (!table.fast) {
    for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
      const int64_t m = std::min(kBlock, hi - b0);
      BlockCounts bc;
      range_block(x + b0, m, &bc);
      cc.add(bc);
      for (int64_t i = b0; i < b0 + m; ++i) {
        const float a = float_of(abs_bits(to_float(x[i])));
        const uint32_t bits = bits_of(a);
        if (bits != 0 && bits < CellTable::kInf) ++out[table.search(a)];
      }
    }
    return;
  }
  const int64_t width = table.special + 1;
  std::vector<uint32_t> lanes(4 * width, 0);
  uint32_t* l0 = lanes.data();
  uint32_t* l1 = l0 + width;
  uint32_t* l2 = l1 + width;
  uint32_t* l3 = l2 + width;
  auto flush = [&] {
    for (int64_t b = 0; b < nb; ++b) out[b] += int64_t{l0[b]} + l1[b] + l2[b] + l3[b];
    std::fill(lanes.begin(), lanes.end(), 0u);
  };
  uint16_t idx[kBlock];
  int64_t since_flush = 0;
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    const int64_t m = std::min(kBlock, hi - b0);
    BlockCounts bc;
    bucket_block(x + b0, m, table.base_t1.data(), table.t2.data(), idx, &bc);
    cc.add(bc);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      ++l0[idx[i]];
      ++l1[idx[i + 1]];
      ++l2[idx[i + 2]];
      ++l3[idx[i + 3]];
    }
    for (; i < m; ++i) ++l0[idx[i]];
    // subnormals (in the extra bucket `sub` with the zeros): looked up in the block, still in cache
    if (bc.subs) subnormal_buckets(x, b0, b0 + m, table, out);
    since_flush += m;
    if (since_flush >= (int64_t{1} << 20)) {
      flush();
      since_flush = 0;
    }
  }
  flush();
}

template <typename T>
void piece_range(const T* x, int64_t lo, int64_t hi, ChunkCounts& cc) {
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    BlockCounts bc;
    range_block(x + b0, std::min(kBlock, hi - b0), &bc);
    cc.add(bc);
  }
}

// The tensor cut into one contiguous piece per thread (counts and maxima are exact in any split): an even split,
// where 32768-element chunks left one of two threads idle for half of a 49152-element tensor.
template <typename T>
void range_pass(const T* x, int64_t numel, const CellTable* table, int64_t nbuckets, int64_t* counts,
                int64_t* special, float* amax_out) {
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / kMinPiece));
  std::vector<std::vector<int64_t>> part_counts(pieces);
  std::vector<ChunkCounts> part(pieces);
  at::parallel_for(0, pieces, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t lo = numel * p / pieces, hi = numel * (p + 1) / pieces;
      if (table) {
        part_counts[p].assign(nbuckets, 0);
        piece_buckets(x, lo, hi, *table, part_counts[p], part[p]);
      } else {
        piece_range(x, lo, hi, part[p]);
      }
    }
  });
  float amax = 0.0f;
  for (int64_t p = 0; p < pieces; ++p) {
    if (table) {
      for (int64_t b = 0; b < nbuckets; ++b) counts[b] += part_counts[p][b];
    }
    special[0] += part[p].zeros;
    special[1] += part[p].nans;
    special[2] += part[p].infs;
    amax = std::max(amax, part[p].amax);
  }
  *amax_out = amax;
}

std::tuple<at::Tensor, at::Tensor, double> range_stats(const at::Tensor& x_in, const std::optional<at::Tensor>& edges_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "range_stats: CPU tensors only");
  at::Tensor x = x_in.contiguous();
  at::Tensor edges;
  int64_t nbuckets = 0;
  if (edges_in.has_value() && edges_in->defined()) {
    edges = edges_in->to(at::kFloat).contiguous();
    nbuckets = edges.numel() + 1;
  }
  at::Tensor counts = at::zeros({nbuckets}, at::kLong);
  at::Tensor special = at::zeros({3}, at::kLong);
  float amax = 0.0f;
  const CellTable* table = edges.defined() ? &cell_table(edges.data_ptr<float>(), edges.numel()) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "range_stats", [&] {
    range_pass<scalar_t>(x.data_ptr<scalar_t>(), x.numel(), table, nbuckets, counts.data_ptr<int64_t>(),
                         special.data_ptr<int64_t>(), &amax);
  });
  return {counts, special, static_cast<double>(amax)};
}

// error_sums' lanes as vectors: element lo + 4k + l of a chunk goes to lane l, in order, as a scalar loop with
// four accumulators per sum does (each lane's additions are the same IEEE operations in the same order, in a
// vector register or not). A non-finite reference element adds +0.0 to every lane (its products with the zeros
// it is replaced by), which changes no sum: a sum that starts at +0.0 is never -0.0, and s + 0.0 == s otherwise.
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

struct ErrorLanes {
  v4d s_r2 = {0, 0, 0, 0}, s_d2 = {0, 0, 0, 0}, s_dot = {0, 0, 0, 0}, s_p2 = {0, 0, 0, 0}, mx = {0, 0, 0, 0};
  v4l nan = {0, 0, 0, 0}, ref_bad = {0, 0, 0, 0}, bad = {0, 0, 0, 0};

  PA_INLINE void add(v4d rv, v4d qv) {
    const v4l ok_r = (v4l)((rv - rv) == 0);  // all ones where the reference is finite (inf - inf, NaN: NaN)
    ref_bad += ~ok_r & 1;
    rv = (v4d)((v4l)rv & ok_r);
    qv = (v4d)((v4l)qv & ok_r);
    bad += ~(v4l)((qv - qv) == 0) & 1;
    const v4d d = qv - rv;
    s_r2 += rv * rv;
    s_d2 += d * d;
    s_dot += rv * qv;
    s_p2 += qv * qv;
    const v4d ad = (v4d)((v4l)d & INT64_MAX);
    nan |= (v4l)(ad != ad);
    const v4l more = (v4l)(ad > mx);  // false for NaN: the maximum of the others, as the scalar loop kept it
    mx = (v4d)(((v4l)ad & more) | ((v4l)mx & ~more));
  }
};

template <typename T>
PA_INLINE v4d load4(const T* x) {
  return v4d{to_double(x[0]), to_double(x[1]), to_double(x[2]), to_double(x[3])};
}

// The same lanes without the masks, for a chunk whose elements are all finite: the sums and the largest |d| only.
// Whether they were is known afterwards from the sums themselves: an inf or NaN in the reference makes s_r2 inf or
// NaN, one in the low-precision values s_p2 (sums of squares cannot cancel), and finite float32/fp16/bf16 values
// cannot overflow a double sum of 32768 squares; a float64 pair that does (or any non-finite sum) is summed again
// by ErrorLanes, which then gives what it always gave. Where every element is finite the masks change nothing, so
// both loops give the same bits.
struct FiniteLanes {
  v4d s_r2 = {0, 0, 0, 0}, s_d2 = {0, 0, 0, 0}, s_dot = {0, 0, 0, 0}, s_p2 = {0, 0, 0, 0}, mx = {0, 0, 0, 0};

  PA_INLINE void add(v4d rv, v4d qv) {
    const v4d d = qv - rv;
    s_r2 += rv * rv;
    s_d2 += d * d;
    s_dot += rv * qv;
    s_p2 += qv * qv;
    const v4d ad = (v4d)((v4l)d & INT64_MAX);
    const v4l more = (v4l)(ad > mx);
    mx = (v4d)(((v4l)ad & more) | ((v4l)mx & ~more));
  }
};

template <typename Lanes, typename R, typename P>
PA_INLINE void add_span(Lanes& e, const R* r, const P* p, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) e.add(load4(r + i), load4(p + i));
  if (i < n) {  // the last elements in their lanes, the rest zeros (they add +0.0)
    R rt[4] = {R(0), R(0), R(0), R(0)};
    P pt[4] = {P(0), P(0), P(0), P(0)};
    for (int64_t k = 0; i + k < n; ++k) {
      rt[k] = r[i + k];
      pt[k] = p[i + k];
    }
    e.add(load4(rt), load4(pt));
  }
}

// fp16 values are widened a block at a time first (its conversion vectorizes in a loop of its own, not four at a
// time); the blocks are multiples of four, so every element keeps its lane.
template <typename Lanes, typename R, typename P>
PA_INLINE void add_chunk(Lanes& e, const R* r, const P* p, int64_t n) {
  if constexpr (std::is_same_v<P, c10::Half>) {
    constexpr int64_t kSpan = 2048;
    float buf[kSpan];
    for (int64_t b = 0; b < n; b += kSpan) {
      const int64_t m = std::min(kSpan, n - b);
      float_block_impl(p + b, m, buf);
      add_span(e, r + b, buf, m);
    }
  } else {
    add_span(e, r, p, n);
  }
}

PA_INLINE double lane_sum(v4d s) { return s[0] + s[1] + s[2] + s[3]; }  // left to right, as s[0] + ... + s[3]

// One chunk (at most 32768 elements: from a multiple of four) into its five figures and two counts.
template <typename R, typename P>
PA_INLINE void error_chunk_impl(const R* r, const P* p, int64_t n, double* sums, int64_t* flags) {
  FiniteLanes f;
  add_chunk(f, r, p, n);
  const double fs[4] = {lane_sum(f.s_r2), lane_sum(f.s_d2), lane_sum(f.s_dot), lane_sum(f.s_p2)};
  if (std::isfinite(fs[0]) && std::isfinite(fs[1]) && std::isfinite(fs[2]) && std::isfinite(fs[3])) {
    std::copy(fs, fs + 4, sums);
    sums[4] = std::max(std::max(f.mx[0], f.mx[1]), std::max(f.mx[2], f.mx[3]));
    flags[0] = flags[1] = 0;
    return;
  }
  ErrorLanes e;
  add_chunk(e, r, p, n);
  sums[0] = lane_sum(e.s_r2);
  sums[1] = lane_sum(e.s_d2);
  sums[2] = lane_sum(e.s_dot);
  sums[3] = lane_sum(e.s_p2);
  const bool any_nan = e.nan[0] | e.nan[1] | e.nan[2] | e.nan[3];
  sums[4] = any_nan ? std::numeric_limits<double>::quiet_NaN()
                    : std::max(std::max(e.mx[0], e.mx[1]), std::max(e.mx[2], e.mx[3]));
  flags[0] = e.ref_bad[0] + e.ref_bad[1] + e.ref_bad[2] + e.ref_bad[3];
  flags[1] = e.bad[0] + e.bad[1] + e.bad[2] + e.bad[3];
}

#define PA_ERROR_KERNEL(R, P)                                                                    \
  PA_CLONES void error_chunk(const R* r, const P* p, int64_t n, double* sums, int64_t* flags) { \
    error_chunk_impl(r, p, n, sums, flags);                                                      \
  }
PA_ERROR_KERNEL(float, float)
PA_ERROR_KERNEL(float, c10::Half)
PA_ERROR_KERNEL(float, c10::BFloat16)
PA_ERROR_KERNEL(float, double)
PA_ERROR_KERNEL(double, double)

// Chunks of 32768 elements: their boundaries fix the summation order, so every sum is the same bits at any thread
// count (and as before this file's vector lanes; tests/capture/test_fused_stats.py re-adds them in Python).
template <typename R, typename P>
void error_pass(const R* r, const P* p, int64_t numel, int64_t* flags, double* sums) {
  const int64_t grain = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (numel + grain - 1) / grain);
  std::vector<std::array<double, 5>> part(chunks, {0, 0, 0, 0, 0});
  std::vector<std::array<int64_t, 2>> part_flags(chunks, {0, 0});
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * grain, hi = std::min(numel, lo + grain);
      error_chunk(r + lo, p + lo, hi - lo, part[c].data(), part_flags[c].data());
    }
  });
  bool nan = false;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int k = 0; k < 4; ++k) sums[k] += part[c][k];
    if (std::isnan(part[c][4])) nan = true; else sums[4] = std::max(sums[4], part[c][4]);
    flags[0] += part_flags[c][0];
    flags[1] += part_flags[c][1];
  }
  if (nan) sums[4] = std::numeric_limits<double>::quiet_NaN();
}

std::tuple<at::Tensor, at::Tensor> error_sums(const at::Tensor& ref_in, const at::Tensor& p_in) {
  TORCH_CHECK(ref_in.device().is_cpu() && p_in.device().is_cpu(), "error_sums: CPU tensors only");
  TORCH_CHECK(ref_in.numel() == p_in.numel(), "error_sums: sizes differ");
  // float32 is the common case; any other pairing goes through float64 (exact for every float format here)
  at::Tensor r = ref_in.contiguous(), p = p_in.contiguous();
  if (r.scalar_type() != at::kFloat || !(p.scalar_type() == at::kFloat || p.scalar_type() == at::kHalf ||
                                         p.scalar_type() == at::kBFloat16)) {
    r = r.to(at::kDouble);
    p = p.to(at::kDouble);
  }
  at::Tensor flags = at::zeros({2}, at::kLong);
  at::Tensor sums = at::zeros({5}, at::kDouble);
  int64_t* f = flags.data_ptr<int64_t>();
  double* s = sums.data_ptr<double>();
  if (r.scalar_type() == at::kDouble) {
    error_pass<double, double>(r.data_ptr<double>(), p.data_ptr<double>(), r.numel(), f, s);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "error_sums", [&] {
      error_pass<float, scalar_t>(r.data_ptr<float>(), p.data_ptr<scalar_t>(), r.numel(), f, s);
    });
  }
  return {flags, sums};
}

// dot64: sum of a[i] * b[i] with each product in double (exact for float32 x float32/fp16/bf16 values) and double
// accumulation, as (a.double() * b.double()).sum() computes it without its two float64 copies: four lanes per
// chunk of 32768 elements, the chunks' partials added in chunk order (the same sum at any thread count; its last
// bits may differ from torch's own reduction order). Non-finite products propagate as in the float64 expression.
template <typename A, typename B>
double dot_pass(const A* a, const B* b, int64_t numel) {
  const int64_t grain = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (numel + grain - 1) / grain);
  std::vector<double> part(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * grain, hi = std::min(numel, lo + grain);
      double s[4] = {0, 0, 0, 0};  // element i in lane i % 4, in blocks of four (lo is a multiple of four)
      int64_t i = lo;
      for (; i + 4 <= hi; i += 4) {
        for (int l = 0; l < 4; ++l) s[l] += to_double(a[i + l]) * to_double(b[i + l]);
      }
      for (int l = 0; i < hi; ++i, ++l) s[l] += to_double(a[i]) * to_double(b[i]);
      part[c] = (s[0] + s[1]) + (s[2] + s[3]);
    }
  });
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += part[c];
  return total;
}

double dot64(const at::Tensor& a_in, const at::Tensor& b_in) {
  TORCH_CHECK(a_in.device().is_cpu() && b_in.device().is_cpu(), "dot64: CPU tensors only");
  TORCH_CHECK(a_in.sizes() == b_in.sizes(), "dot64: shapes differ");
  at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  if (a.scalar_type() != at::kFloat || !(b.scalar_type() == at::kFloat || b.scalar_type() == at::kHalf ||
                                         b.scalar_type() == at::kBFloat16)) {
    a = a.to(at::kDouble);
    b = b.to(at::kDouble);
    return dot_pass<double, double>(a.data_ptr<double>(), b.data_ptr<double>(), a.numel());
  }
  double out = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "dot64", [&] {
    out = dot_pass<float, scalar_t>(a.data_ptr<float>(), b.data_ptr<scalar_t>(), a.numel());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(precision_audit_emu, m) {
  m.def("enable(str[] gemm, str[] fp32, str[] fp32_set_opt_dtype) -> ()", &enable_op);
  m.def("disable() -> ()", &disable);
  m.def("set_recording(bool on) -> ()", &set_recording);
  m.def("drain() -> (Tensor[], int[], bool[])", &drain);
  m.def("range_stats(Tensor x, Tensor? edges) -> (Tensor, Tensor, float)", &range_stats);
  m.def("error_sums(Tensor ref, Tensor p) -> (Tensor, Tensor)", &error_sums);
  m.def("dot64(Tensor a, Tensor b) -> float", &dot64);
  m.def("set_avx512(bool on) -> bool", &set_avx512);
}
