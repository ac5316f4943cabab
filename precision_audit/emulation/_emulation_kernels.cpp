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

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
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

// The bucket of a finite |x| > 0 from its float32 bits, without a search. Positive floats order as their bits, so
// the cell `bits >> 19` (the exponent and the top four mantissa bits) fixes the bucket up to the edges strictly
// inside the cell; every cell of a normal binade holds at most two of them here (the FP16 maximum 65504 and its
// overflow threshold 65520, at every loss scale, share a cell), so
//     bucket = base + (low >= t1) + (low >= t2),   low = bits & 0x7FFFF,
// with an absent edge's threshold 0x80000, above every `low`. One 64-bit word per cell holds base | t1 | t2.
// Cells of exponent 0 (zero and the subnormals) map to the extra bucket `sub`, which the pass resolves afterwards
// (zeros are counted apart; a subnormal, rare in any model, by a binary search); inf and NaN to `special`.
// An edge list with more edges in a cell (or none: RangeSummary) takes the binary search for every value.
struct CellTable {
  static constexpr int kShift = 19;
  static constexpr uint32_t kLow = (1u << kShift) - 1, kNone = 1u << kShift, kInf = 0x7f800000u;
  static constexpr uint32_t kCells = (kInf >> kShift) + 1;
  bool fast = false;
  int64_t n = 0, sub = 0, special = 0;  // edges; the two extra buckets
  std::vector<float> edges;
  std::vector<uint64_t> cell;

  explicit CellTable(const float* e, int64_t size) : n(size), sub(size + 1), special(size + 2), edges(e, e + size) {
    if (size + 2 > 0xFFFF) return;  // the base must fit its 16 bits
    cell.assign(kCells, 0);
    for (uint32_t c = 0; c < kCells; ++c) {
      const uint32_t lo = c << kShift;
      if ((lo >> 23) == 0) {
        cell[c] = pack(sub, kNone, kNone);
        continue;
      }
      if (lo >= kInf) {
        cell[c] = pack(special, kNone, kNone);
        continue;
      }
      const float* p = std::upper_bound(edges.data(), edges.data() + n, float_of(lo));
      const uint64_t base = p - edges.data();
      uint32_t t[2] = {kNone, kNone};
      int k = 0;
      for (; p < edges.data() + n && bits_of(*p) < lo + kNone; ++p, ++k) {
        if (k == 2) return;  // three edges in one cell: not this table's case
        t[k] = bits_of(*p) & kLow;
      }
      cell[c] = pack(base, t[0], t[1]);
    }
    fast = true;
  }

  static uint64_t pack(uint64_t base, uint64_t t1, uint64_t t2) { return base | t1 << 16 | t2 << 36; }

  int64_t bucket(uint32_t bits) const {  // bits of a finite float32 > 0
    const uint64_t w = cell[std::min(bits, kInf) >> kShift];
    const uint32_t low = bits & kLow;
    return static_cast<int64_t>(w & 0xFFFF) + (low >= ((w >> 16) & 0xFFFFF)) + (low >= (w >> 36));
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
inline float to_float(float v) { return v; }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return float_of(static_cast<uint32_t>(v.x) << 16); }
inline float to_float(c10::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t two_w = w + w;
  const float normal = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t sub = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones for a subnormal or zero
  return float_of((w & 0x80000000u) | (bits_of(subnormal) & sub) | (bits_of(normal) & ~sub));
}
// ... and to double (exact from any of them).
template <typename T>
inline double to_double(T v) {
  return static_cast<double>(to_float(v));
}
inline double to_double(double v) { return v; }

inline uint32_t abs_bits(float v) { return bits_of(v) & 0x7fffffffu; }

inline float finite_or_zero(float a, uint32_t bits) { return bits < CellTable::kInf ? a : 0.0f; }

// The statistics of one chunk, branch-free per element (zeros, NaNs and infs come from the bits).
struct ChunkCounts {
  int64_t zeros = 0, nans = 0, infs = 0;
  float amax = 0.0f;
  void add(uint32_t bits, float a) {
    zeros += bits == 0;
    infs += bits == CellTable::kInf;
    nans += bits > CellTable::kInf;
    const float f = finite_or_zero(a, bits);
    amax = f > amax ? f : amax;
  }
};

template <typename T>
void chunk_buckets(const T* x, int64_t lo, int64_t hi, const CellTable& table, std::vector<int64_t>& out,
                   ChunkCounts& cc) {
  const int64_t nb = table.n + 1;
  if (!table.fast) {
    for (int64_t i = lo; i < hi; ++i) {
      const float a = std::fabs(to_float(x[i]));
      const uint32_t bits = abs_bits(a);
      cc.add(bits, a);
      if (bits != 0 && bits < CellTable::kInf) ++out[table.search(a)];
    }
    return;
  }
  // four interleaved histograms (of the buckets and the two extra ones), so that runs of equal buckets do not
  // wait on one counter
  const int64_t width = nb + 2;
  std::vector<uint32_t> lanes(4 * width, 0);
  for (int64_t i = lo; i < hi; ++i) {
    const float a = std::fabs(to_float(x[i]));
    const uint32_t bits = abs_bits(a);
    cc.add(bits, a);
    ++lanes[(i & 3) * width + table.bucket(bits)];
  }
  for (int64_t b = 0; b < nb; ++b) out[b] += lanes[b] + lanes[width + b] + lanes[2 * width + b] + lanes[3 * width + b];
  const int64_t sub = lanes[table.sub] + lanes[width + table.sub] + lanes[2 * width + table.sub] +
                      lanes[3 * width + table.sub];
  if (sub > cc.zeros) {  // subnormals: a second look at this chunk, still in cache
    for (int64_t i = lo; i < hi; ++i) {
      const float a = std::fabs(to_float(x[i]));
      const uint32_t bits = abs_bits(a);
      if (bits != 0 && bits < 0x00800000u) ++out[table.search(a)];
    }
  }
}

// Zeros, NaNs, infs and the largest finite |x| of x[lo:hi] (at most one chunk: 32-bit counts), one `omp simd`
// loop (counts and a maximum are exact in any order). The sign is cleared on the bits, not by std::fabs, which
// keeps GCC from vectorizing the loop.
template <typename T>
void range_lanes(const T* x, int64_t lo, int64_t hi, ChunkCounts& cc) {
  int32_t zeros = 0, nans = 0, infs = 0;
  float amax = 0.0f;
#pragma omp simd reduction(+ : zeros, nans, infs) reduction(max : amax)
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t bits = abs_bits(to_float(x[i]));
    const float a = float_of(bits);
    zeros += bits == 0;
    infs += bits == CellTable::kInf;
    nans += bits > CellTable::kInf;
    const float f = bits < CellTable::kInf ? a : 0.0f;
    amax = f > amax ? f : amax;
  }
  cc.zeros += zeros;
  cc.nans += nans;
  cc.infs += infs;
  cc.amax = std::max(cc.amax, amax);
}

template <typename T>
void range_pass(const T* x, int64_t numel, const CellTable* table, int64_t nbuckets, int64_t* counts,
                int64_t* special, float* amax_out) {
  const int64_t grain = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (numel + grain - 1) / grain);
  std::vector<std::vector<int64_t>> part_counts(chunks);
  std::vector<ChunkCounts> part(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * grain, hi = std::min(numel, lo + grain);
      ChunkCounts cc;
      if (table) {
        part_counts[c].assign(nbuckets, 0);
        chunk_buckets(x, lo, hi, *table, part_counts[c], cc);
      } else {  // no buckets: counts and the maximum in one vectorized pass (range_lanes)
        range_lanes(x, lo, hi, cc);
      }
      part[c] = cc;
    }
  });
  float amax = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (table) {
      for (int64_t b = 0; b < nbuckets; ++b) counts[b] += part_counts[c][b];
    }
    special[0] += part[c].zeros;
    special[1] += part[c].nans;
    special[2] += part[c].infs;
    amax = std::max(amax, part[c].amax);
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

template <typename R, typename P>
void error_pass(const R* r, const P* p, int64_t numel, int64_t* flags, double* sums) {
  const int64_t grain = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (numel + grain - 1) / grain);
  std::vector<std::array<double, 5>> part(chunks, {0, 0, 0, 0, 0});
  std::vector<std::array<int64_t, 2>> part_flags(chunks, {0, 0});
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * grain, hi = std::min(numel, lo + grain);
      // four independent lanes per sum (double accumulation of exact float products)
      double s_r2[4] = {0, 0, 0, 0}, s_d2[4] = {0, 0, 0, 0}, s_dot[4] = {0, 0, 0, 0}, s_p2[4] = {0, 0, 0, 0};
      double mx = 0.0;
      bool mx_nan = false;
      int64_t ref_bad = 0, bad = 0;
      for (int64_t i = lo; i < hi; ++i) {
        const double rv = to_double(r[i]);
        if (!std::isfinite(rv)) {
          ++ref_bad;
          continue;
        }
        const double qv = to_double(p[i]);
        if (!std::isfinite(qv)) ++bad;
        const double d = qv - rv;
        const int l = static_cast<int>(i & 3);
        s_r2[l] += rv * rv;
        s_d2[l] += d * d;
        s_dot[l] += rv * qv;
        s_p2[l] += qv * qv;
        const double ad = std::fabs(d);
        if (std::isnan(ad)) mx_nan = true; else mx = ad > mx ? ad : mx;
      }
      part[c] = {s_r2[0] + s_r2[1] + s_r2[2] + s_r2[3], s_d2[0] + s_d2[1] + s_d2[2] + s_d2[3],
                 s_dot[0] + s_dot[1] + s_dot[2] + s_dot[3], s_p2[0] + s_p2[1] + s_p2[2] + s_p2[3],
                 mx_nan ? std::numeric_limits<double>::quiet_NaN() : mx};
      part_flags[c] = {ref_bad, bad};
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
}
