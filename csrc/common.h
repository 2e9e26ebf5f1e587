// Shared helpers of the kltriton C++ CPU backend: SIMD math, row addressing and argument checks. The row
// kernels are inline templates in row_forward.h, row_backward.h and loss_coefficients.h; each op is defined
// in a thin translation unit (stream_forward.cpp, stream_backward.cpp, loss_forward.cpp, ...) that registers
// it as the op's CPU kernel there (TORCH_LIBRARY_IMPL), so its signature is written once; ops.cpp holds
// the schemas. Every value shared with Python (target sentinels, request and basis bits, statistic indices,
// hyperparameter slots) comes from kltriton/kernels/constants.py as a -D flag.
//
// Compiled with the instruction-set flags of the machine's ATen CPU capability
// (-DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 ...), so at::vec::Vectorized<float>
// is the 512/256-bit specialisation, or the portable one for DEFAULT.
#pragma once

#include <iterator>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <string>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace kltriton_cpp {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();  // floats per vector register
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kMaxFloat = std::numeric_limits<float>::max();

// Per-row target sentinels, defined once in kltriton/kernels/constants.py and passed as -D flags.
constexpr int64_t kSkip = KLTRITON_SKIP;               // not scored: outputs 0, never read
constexpr int64_t kOutOfRange = KLTRITON_OUT_OF_RANGE;  // label outside [0, V): outputs NaN, never read


// fn(TypeTag<T>{}) with T the C++ type of a float32 / bfloat16 / float16 tensor.
template <typename T>
struct TypeTag {
  using type = T;
};
template <typename F>
inline void with_dtype(at::ScalarType dtype, F&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(TypeTag<float>{});
    case at::kBFloat16: return fn(TypeTag<at::BFloat16>{});
    case at::kHalf: return fn(TypeTag<at::Half>{});
    default: TORCH_CHECK(false, "kltriton_cpp: unsupported dtype ", dtype);
  }
}

// fn(TypeTag<T>{}, TypeTag<R>{}): T of the logits, R of the reference logits (its own dtype: a bf16
// policy with an fp32 reference is read as it is, never copied). Without a reference R = T, so
// the variants that never read one are instantiated once per T.
template <typename F>
inline void with_dtypes(at::ScalarType dtype, const std::optional<at::Tensor>& ref, F&& fn) {
  with_dtype(dtype, [&](auto tag) {
    if (ref.has_value()) {
      with_dtype(ref->scalar_type(), [&](auto ref_tag) { fn(tag, ref_tag); });
    } else {
      fn(tag, tag);
    }
  });
}

// fn(std::integral_constant<int, M>{}) for the runtime bitmask `mode`, which must be one of MODES
// (the variants a kernel instantiates).
template <int... MODES, typename F>
inline void with_mode(int mode, F&& fn) {
  const bool found = ((mode == MODES ? (fn(std::integral_constant<int, MODES>{}), true) : false) || ...);
  TORCH_CHECK(found, "kltriton_cpp: no kernel variant for mode ", mode);
}

// with_mode over every bitmask below LIMIT that VALID<M>::value accepts: the variants follow from the bits
// (kltriton/kernels/constants.py), so a new request bit or basis term instantiates its own.
template <bool VALID, int M, typename F>
inline bool call_if_mode(int mode, F& fn) {
  if constexpr (VALID) {
    if (mode == M) {
      fn(std::integral_constant<int, M>{});
      return true;
    }
  }
  return false;
}
template <template <int> class VALID, typename F, int... Ms>
inline void with_valid_mode(int mode, F& fn, std::integer_sequence<int, Ms...>) {
  const bool found = (call_if_mode<VALID<Ms>::value, Ms>(mode, fn) || ...);
  TORCH_CHECK(found, "kltriton_cpp: no kernel variant for mode ", mode);
}
template <int LIMIT, template <int> class VALID, typename F>
inline void with_any_mode(int mode, F&& fn) {
  with_valid_mode<VALID>(mode, fn, std::make_integer_sequence<int, LIMIT>{});
}

// The per-row float32 entries of a list of optional [N] tensors (a gradient basis), nullptr where absent;
// `keep` holds the contiguous float32 copies alive.
template <int SIZE>
inline void rows_of(const c10::List<std::optional<at::Tensor>>& list, int64_t N, const float* (&out)[SIZE],
                    std::vector<at::Tensor>& keep) {
  TORCH_CHECK(static_cast<int>(list.size()) == SIZE, "kltriton_cpp: expected ", SIZE, " entries, got ", list.size());
  for (int i = 0; i < SIZE; ++i) {
    const std::optional<at::Tensor> t = list.get(i);
    out[i] = nullptr;
    if (!t.has_value()) continue;
    TORCH_CHECK(t->numel() == N, "kltriton_cpp: every entry must have one value per row");
    keep.push_back(t->to(at::kFloat).contiguous());
    out[i] = keep.back().data_ptr<float>();
  }
}

// kW consecutive elements as floats.
template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// 2 * kW consecutive elements as two float vectors.
template <typename T>
inline void load_f2(const T* p, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + kW);
  } else {
    at::vec::load_to_float<T>(p, a, b);
  }
}

// Stores two float vectors as 2 * kW elements of T.
template <typename T>
inline void store_f2(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kW);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// Bytes one stream_f2 call writes with each non-temporal store (the alignment it needs), 0 without them.
#if defined(CPU_CAPABILITY_AVX512)
constexpr uintptr_t kStreamAlign = 64;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr uintptr_t kStreamAlign = 32;
#else
constexpr uintptr_t kStreamAlign = 0;
#endif

// Whether stream_f2 may write at p: non-temporal stores need p aligned to their width.
template <typename T>
inline bool streamable(const T* p) {
  return kStreamAlign != 0 && reinterpret_cast<uintptr_t>(p) % kStreamAlign == 0;
}

// store_f2 with non-temporal (streaming) stores, for p with streamable(p): they write around the cache, with no
// read of the destination line first. For a gradient that is read back long after it is written (the fused
// loss's, read in the backward), so that it neither costs a read nor evicts the rows being streamed. The writer
// calls _mm_sfence() before its results are read by another thread.
template <typename T>
inline void stream_f2(T* p, const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    _mm512_stream_ps(p, a);
    _mm512_stream_ps(p + kW, b);
  } else {
    store_f2(p, a, b);  // 2 * 16 half floats: 64 bytes, one 512-bit line; kept as an ordinary store
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    _mm256_stream_ps(p, a);
    _mm256_stream_ps(p + kW, b);
  } else {
    const at::vec::Vectorized<T> packed = at::vec::convert_from_float<T>(a, b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
  }
#else
  store_f2(p, a, b);
#endif
}

// a * b + c with one rounding: x * invT - shift must not round x * invT at the scale of |x| / T
// (1e4-sized logits would lose ~1e-3 absolute). AVX2 / AVX512 have FMA; the portable build calls
// std::fma per lane (slow without FMA hardware, but exact).
inline Vec vfma(const Vec& a, const Vec& b, const Vec& c) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::fmadd(a, b, c);
#else
  alignas(64) float xa[kW], xb[kW], xc[kW];
  a.store(xa);
  b.store(xb);
  c.store(xc);
  for (int64_t l = 0; l < kW; ++l) xa[l] = std::fma(xa[l], xb[l], xc[l]);
  return Vec::loadu(xa);
#endif
}

// The forward's exponents z are in units of kZUnit nats and vexpz(z) = exp(z * kZUnit): base 2 on
// AVX512 (vexp2 is two FMA-pipe ops cheaper than vexp), natural elsewhere (ATen's exp_u20 works in
// nats: a base-2 argument would cost one more multiply).
#if defined(CPU_CAPABILITY_AVX512)
constexpr double kZUnit = 0.693147180559945309;  // ln 2
#else
constexpr double kZUnit = 1.0;
#endif

// Polynomial coefficients, highest degree first (Horner): e^r on [-ln2/2, ln2/2] (Cephes expf, degree 6 of 7) and
// 2^r on [-1/2, 1/2] (a relative-minimax fit of degree 5). The vector exponentials below evaluate them.
constexpr float kExpPoly[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                              5.0000001201e-1f, 1.f, 1.f};
constexpr float kExp2Poly[] = {1.326472731307149e-3f, 9.671512991189957e-3f, 5.550733581185341e-2f,
                               2.4022242426872253e-1f, 6.931470036506653e-1f, 1.f};

#if defined(CPU_CAPABILITY_AVX512)
// exp(z) for z <= ~0 in 11 AVX512 ops, ~2 ulp: n = round(z / ln2), r = z - n ln2 in
// [-ln2/2, ln2/2], e^r by a degree-6 polynomial (Cephes expf coefficients; the degree-7 term is
// dropped, truncation < 1.3e-7 relative), scaled by 2^n with scalef (exact underflow to 0).
// z = -inf or below -104 gives 0; NaN stays NaN (the clamp returns its second operand).
inline Vec vexp(const Vec& zv) {
  const __m512 z = _mm512_max_ps(_mm512_set1_ps(-104.f), zv);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), z);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (size_t i = 1; i < std::size(kExpPoly); ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^w for w <= ~0 in 9 AVX512 ops, ~3 ulp: n = round(w), r = w - n in [-1/2, 1/2], 2^r by a degree-5
// polynomial (relative-minimax fit, 1.9e-7 relative error in fp32 Horner), scaled by 2^n with
// scalef. Two FMA-pipe ops fewer than vexp (no multiply by log2(e), no Cody-Waite step): the forward
// keeps its exponents in base-2 units (kZUnit). w = -inf or below -150 gives 0; NaN stays NaN.
inline Vec vexp2(const Vec& wv) {
  const __m512 w = _mm512_max_ps(_mm512_set1_ps(-150.f), wv);
  const __m512 n = _mm512_roundscale_ps(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(w, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (size_t i = 1; i < std::size(kExp2Poly); ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

inline Vec vexpz(const Vec& z) { return vexp2(z); }

// Running max; NaN need not propagate here because vexp keeps NaN (the sums become NaN).
inline Vec vmax(const Vec& a, const Vec& b) { return _mm512_max_ps(a, b); }

// The largest lane, in every lane (NaN need not propagate, as for vmax).
inline Vec hmax(const Vec& v) { return Vec(_mm512_reduce_max_ps(v)); }

// acc + (e != 0 ? c : 0): a term with no probability mass is 0 even when c is inf / NaN.
inline Vec add_where_pos(const Vec& acc, const Vec& e, const Vec& c) {
  const __mmask16 k = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  return _mm512_mask_add_ps(acc, k, acc, c);
}

// -p * c, or 0 where p == 0.
inline Vec neg_mul_where_pos(const Vec& p, const Vec& c) {
  const __mmask16 k = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  return _mm512_maskz_mul_ps(k, _mm512_sub_ps(_mm512_setzero_ps(), p), c);
}
#else
// exp with ~20 ulp, no Sleef call on AVX2 (the one ATen's softmax uses). It does not keep NaN,
// so the running max below propagates NaN instead.
inline Vec vexp(const Vec& z) { return z.exp_u20(); }

inline Vec vexpz(const Vec& z) { return z.exp_u20(); }

inline Vec vmax(const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }

// The largest lane, in every lane; NaN propagates (as for vmax).
inline Vec hmax(const Vec& v) {
  alignas(64) float a[kW];
  v.store(a);
  float m = a[0];
  for (int64_t l = 1; l < kW; ++l) m = (std::isnan(m) || a[l] <= m) ? m : a[l];
  return Vec(m);
}

inline Vec add_where_pos(const Vec& acc, const Vec& e, const Vec& c) {
  const Vec zero(0.f);
  return acc + Vec::blendv(c, zero, e == zero);
}

inline Vec neg_mul_where_pos(const Vec& p, const Vec& c) {
  const Vec zero(0.f);
  return Vec::blendv(zero - p * c, zero, p == zero);
}
#endif

// A divergence's value, its rounding below 0 (nearly identical distributions) read as 0; -0 as +0, NaN kept.
inline double nonnegative(double value) { return value <= 0.0 ? 0.0 : value; }

// Row n of an [A, B, V] view with strides (sa, sb, 1).
struct Rows3d {
  const char* base = nullptr;
  int64_t B = 1, sa = 0, sb = 0, elem = 4;
  Rows3d() = default;
  explicit Rows3d(const at::Tensor& t)
      : base(static_cast<const char*>(t.data_ptr())),
        B(t.size(1)),
        sa(t.stride(0)),
        sb(t.stride(1)),
        elem(t.element_size()) {}
  template <typename T>
  const T* row(int64_t n) const {
    const int64_t a = n / B, b = n - (n / B) * B;
    return reinterpret_cast<const T*>(base + (a * sa + b * sb) * elem);
  }
};

inline void check_rows3d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kltriton_cpp: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3, "kltriton_cpp: ", name, " must be an [A, B, V] view");
  TORCH_CHECK(t.size(2) == 0 || t.size(2) == 1 || t.stride(2) == 1,
              "kltriton_cpp: ", name, " needs a contiguous vocab dim");
  auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "kltriton_cpp: ", name, " must be float32, bfloat16 or float16, got ", dt);
}

// Temperature of each row: a float64 tensor with one entry for all rows or one per row.
struct Temperatures {
  const double* t = nullptr;
  bool per_row = false;
  // 1 / T of row n, split as hi + lo with hi = float(1 / T): z = x * hi + x * lo keeps x / T exact
  // to fp32 rounding even for |x| ~ 1e4.
  inline void inverse(int64_t n, float& hi, double& lo) const {
    const double inv = 1.0 / t[per_row ? n : 0];
    hi = static_cast<float>(inv);
    lo = inv - static_cast<double>(hi);
  }
};

// Checks shared by both ops: the policy view, the per-row target and the temperature.
// Returns {N, V}: rows and vocabulary size.
inline std::pair<int64_t, int64_t> check_stream_args(const at::Tensor& logits3d, const at::Tensor& target,
                                                     const at::Tensor& temperature) {
  check_rows3d(logits3d, "logits");
  const int64_t N = logits3d.size(0) * logits3d.size(1);
  const int64_t V = logits3d.size(2);
  TORCH_CHECK(V > 0, "kltriton_cpp: the vocabulary size must be > 0");
  TORCH_CHECK(temperature.scalar_type() == at::kDouble && temperature.is_contiguous() &&
                  (temperature.numel() == 1 || temperature.numel() == N),
              "kltriton_cpp: temperature must be a contiguous float64 tensor with 1 or N entries");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == N,
              "kltriton_cpp: target must be a contiguous int64 tensor with one entry per row");
  return {N, V};
}

// Rows per parallel task: enough vocabulary to amortise the task overhead.
inline int64_t row_grain(int64_t vocab) {
  const int64_t g = (int64_t{1} << 15) / std::max<int64_t>(vocab, 1);
  return std::max<int64_t>(g, 1);
}

// A new uninitialized contiguous [N, V] gradient (gradient_buffer.cpp: large ones are reused).
at::Tensor gradient_buffer(int64_t N, int64_t V, const at::TensorOptions& options);

// Gives the cached gradient block (if any) back to the OS; returns its size in bytes.
int64_t empty_gradient_cache();

}  // namespace kltriton_cpp
