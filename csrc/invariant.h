// The invariant family's row kernels (kltriton/kernels/invariant/__init__.py), inline templates: a row's largest
// read entry, and given it (the maximum of the whole row, over every vocab shard), fixed-point sums of
// e = exp((x - m) / T) and of e * (m - x) / T, each term truncated to int64 units of 2^-KLTRITON_FIXED_POINT_BITS.
//
// Every entry goes through the same vector code wherever it sits in a row: whole vectors, then the tail as one more
// vector padded with -inf (e = 0: it adds 0). Integer addition is associative, so the sums, like the maximum, do not
// depend on where the row is cut (vocab shards, LinearLogits tiles, vectors, blocks) or on the threads. Exponents
// are in kZUnit units as row_forward.h's (base 2 on AVX512); the entropy terms in nats.
#pragma once

#include "common.h"

namespace kltriton_cpp {

constexpr float kInvariantUnit = static_cast<float>(int64_t{1} << KLTRITON_FIXED_POINT_BITS);
constexpr int64_t kFlushVecs = 64;  // vectors between FixedSum flushes

// Adds trunc(v) of the kW lanes of v (non-negative, integral part below 2^53) to an int64 total, exactly.
struct FixedSum {
#if defined(CPU_CAPABILITY_AVX512)
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  inline void add(const Vec& v) {
    const __m512 f = v;
    lo = _mm512_add_epi64(lo, _mm512_cvttps_epi64(_mm512_castps512_ps256(f)));
    hi = _mm512_add_epi64(hi, _mm512_cvttps_epi64(_mm512_extractf32x8_ps(f, 1)));
  }
  inline void flush() {}
  inline int64_t total() { return _mm512_reduce_add_epi64(lo) + _mm512_reduce_add_epi64(hi); }
#elif defined(CPU_CAPABILITY_AVX2)
  // No float -> int64 conversion on AVX2: truncated floats are summed in double lanes, exact while below 2^53
  // (kFlushVecs adds of terms below 2^41 per flush), and flushed into the int64 total.
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t sum = 0;
  inline void add(const Vec& v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(t)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1)));
  }
  inline void flush() {
    alignas(32) double a[8];
    _mm256_store_pd(a, lo);
    _mm256_store_pd(a + 4, hi);
    for (double d : a) sum += static_cast<int64_t>(d);
    lo = _mm256_setzero_pd();
    hi = _mm256_setzero_pd();
  }
  inline int64_t total() {
    flush();
    return sum;
  }
#else
  int64_t sum = 0;
  inline void add(const Vec& v) {
    alignas(64) float a[kW];
    v.store(a);
    for (int64_t l = 0; l < kW; ++l) sum += static_cast<int64_t>(a[l]);
  }
  inline void flush() {}
  inline int64_t total() { return sum; }
#endif
};

// fn(v) for every vector of x[0, V) as floats, the tail padded with -inf; entries below `floor` read as -inf
// (FLOOR). after_block() after every kFlushVecs vectors.
template <typename T, bool FLOOR, typename F, typename B>
inline void for_each_vector(const T* x, int64_t V, float floor, const F& fn, const B& after_block) {
  const Vec vfloor(floor), ninf(-kInf);
  auto read = [&](const Vec& v) {
    if constexpr (FLOOR) return Vec::blendv(v, ninf, v < vfloor);
    return v;
  };
  const int64_t nvec = V / kW, rem = V - nvec * kW;
  for (int64_t v0 = 0; v0 < nvec; v0 += kFlushVecs) {
    const int64_t end = std::min(nvec, v0 + kFlushVecs);
    for (int64_t i = v0; i < end; ++i) fn(read(load_f(x + i * kW)));
    after_block();
  }
  if (rem) {
    alignas(64) float tail[kW];
    for (int64_t l = 0; l < kW; ++l) tail[l] = l < rem ? static_cast<float>(x[nvec * kW + l]) : -kInf;
    fn(read(Vec::loadu(tail)));
    after_block();
  }
}

// The row's largest read entry; +inf where a NaN or +inf is read, -inf where none is above -inf.
template <typename T, bool FLOOR>
inline float invariant_row_max(const T* x, int64_t V, float floor) {
  Vec m(-kInf);
  for_each_vector<T, FLOOR>(x, V, floor, [&](const Vec& v) { m = at::vec::maximum(m, v); }, [] {});
  alignas(64) float lanes[kW];
  m.store(lanes);
  float out = -kInf;
  for (int64_t l = 0; l < kW; ++l) {
    if (std::isnan(lanes[l])) return kInf;
    out = std::max(out, lanes[l]);
  }
  return out;
}

// mass = sum trunc(e 2^F) and (ENT) weighted = sum trunc(e d 2^F), e = exp(z), z = (x - m) c in kZUnit units
// (c = 1 / (T kZUnit)), d = -z kZUnit in nats; m the row's (global) maximum, finite.
template <typename T, bool FLOOR, bool ENT>
inline void invariant_row_sums(const T* x, int64_t V, float m, float c, float floor, int64_t* mass,
                               int64_t* weighted) {
  const Vec vm(m), vc(c), unit(kInvariantUnit), nats(static_cast<float>(-kZUnit)), zero(0.f);
  FixedSum s, w;
  for_each_vector<T, FLOOR>(
      x, V, floor,
      [&](const Vec& v) {
        const Vec z = (v - vm) * vc;  // <= 0; -inf for -inf entries
        const Vec e = vexpz(z);       // in [0, 1]
        s.add(e * unit);
        if constexpr (ENT) w.add(Vec::blendv(e * (z * nats) * unit, zero, e == zero));  // 0 * inf: 0
      },
      [&] {
        s.flush();
        if constexpr (ENT) w.flush();
      });
  *mass = s.total();
  if constexpr (ENT) *weighted = w.total();
}

// c of a row: 1 / (T kZUnit) as row_forward.h forms it.
inline float invariant_scale(const Temperatures& temp, int64_t n) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  return static_cast<float>((static_cast<double>(hi) + lo) / kZUnit);
}

}  // namespace kltriton_cpp
