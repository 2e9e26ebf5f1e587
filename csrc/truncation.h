// The truncation family on the CPU (inline templates): per row, the floor of vLLM v1's min-p, top-k and top-p
// (in that order; kltriton/kernels/truncation/__init__.py states the semantics), found by selection without
// sorting the row, and a list that holds the kept set {x >= floor}.
//
// Every step keeps an upper set of the row, so each row gathers one *list*: the logits >= a threshold that is at
// most the floor, the whole kept set and a few logits below it. Its statistics are then forward_row
// (row_forward.h) over the list with FLOOR, not another pass over the row. Passes over a row of V logits:
//   1. scan: the row max m (min-p's threshold m + T log(min_p) follows), NaN / +inf, and with top-k the per-lane
//      maxima of blocks of V / (2k) logits: 2k "group maxima". At least k logits are >= the k-th largest group
//      maximum, so it is at most the k-th largest logit, and about 1.25 k logits (random order) are >= it;
//   2. top-p without top-k only: a census: the probability masses exp((x - m) / T) of the logits >= each of
//      kCensus thresholds m - T d (d = kCensusDepth: 0.5 ... 12) and in total. The highest threshold whose
//      mass reaches top_p times the total starts the list; the cut lies between it and the next one up;
//   3. gather: the list, the logits >= that threshold (top-k: the k-th group maximum; top-p: the census'
//      threshold; min-p alone: min-p's), compacted with SIMD compress stores.
// Then, on the list only: top-k's k-th largest (nth_element); top-p's cut among the candidates of its bracket
// (the top-k kept set after top-k): censuses at kCensus evenly spaced thresholds drop the candidates outside
// the bracket holding the cut until at most kFewCandidates are left, which are sorted; the statistics.
// min-p or top-k: 2 passes over the row; top-p: 3; the first reads memory, the others hit L1 / L2.
#pragma once

#include <algorithm>
#include <array>
#include <functional>

#include "common.h"
#include "row_forward.h"

namespace kltriton_cpp {

constexpr int kCensus = 6;                 // thresholds of a census
constexpr int64_t kFewCandidates = 64;     // top-p candidates sorted at the end
constexpr int64_t kCensusFlush = 64;       // vectors summed in fp32 before a census adds them to double
constexpr int64_t kGroupsPerK = 2;         // top-k: group maxima per k
// The row census's thresholds, in units of T below the row max: denser near the max, where a peaked row's cut is.
constexpr float kCensusDepth[kCensus] = {0.5f, 1.5f, 3.f, 5.f, 8.f, 12.f};

// The row's knobs: k (0 off), p (1 off), min_p (0 off).
struct Knobs {
  int64_t k;
  double p, min_p;
};

// Buffers of one thread, reused from row to row.
struct TruncationScratch {
  std::vector<float> groups;  // top-k's group maxima
  std::vector<float> list;    // the kept set and the logits just below it; the label's logit after them
  std::vector<float> cand;    // top-p's candidates
};

// The smallest fp32 >= value (so that x >= result in fp32 iff x >= value for fp32 x).
inline float fp32_at_least(double value) {
  float f = static_cast<float>(value);
  if (static_cast<double>(f) < value) f = std::nextafter(f, kInf);
  return f;
}

inline double lane_sum(const Vec& v) {
  alignas(64) float a[kW];
  v.store(a);
  double s = 0.0;
  for (int64_t l = 0; l < kW; ++l) s += a[l];
  return s;
}

// x[i..i + kW) as floats, the lanes at or past n set to -inf (the last, partial vector of a row).
template <typename T>
inline Vec load_tail(const T* x, int64_t i, int64_t n) {
  alignas(64) float a[kW];
  for (int64_t l = 0; l < kW; ++l) a[l] = i + l < n ? static_cast<float>(x[i + l]) : -kInf;
  return Vec::loadu(a);
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// Lane permutations that move the lanes set in an 8-bit mask to the front, in order (AVX2 has no compress).
struct CompressTable {
  alignas(32) int32_t perm[256][8];
  constexpr CompressTable() : perm() {
    for (int mask = 0; mask < 256; ++mask) {
      int k = 0;
      for (int l = 0; l < 8; ++l) {
        if (mask & (1 << l)) perm[mask][k++] = l;
      }
      for (; k < 8; ++k) perm[mask][k] = 0;
    }
  }
};
inline constexpr CompressTable kCompress{};
#endif

// Stores the lanes of v where keep is set at out[0..), in order; returns how many. Writes up to kW floats.
inline int64_t compress_store(const Vec& v, const Vec& keep, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 mask = _mm512_movepi32_mask(_mm512_castps_si512(keep));
  _mm512_mask_compressstoreu_ps(out, mask, v);
  return __builtin_popcount(mask);
#elif defined(CPU_CAPABILITY_AVX2)
  const int mask = _mm256_movemask_ps(keep);
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.perm[mask]));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(v, perm));
  return __builtin_popcount(mask);
#else
  alignas(64) float a[kW], k[kW];
  v.store(a);
  keep.store(k);
  int64_t n = 0;
  for (int64_t l = 0; l < kW; ++l) {
    if (k[l] != 0.f) out[n++] = a[l];  // the mask lanes are all-ones (a NaN) or all-zero bits
  }
  return n;
#endif
}

// The logits of x[0..n) that are >= lo and < hi, as floats at out[0..); returns how many. out needs n + kW
// floats; out may be x itself (float) (a vector is loaded before its lanes are stored, never past them).
template <typename T>
inline int64_t gather_between(const T* x, int64_t n, float lo, float hi, float* out) {
  const Vec vlo(lo), vhi(hi);
  const int64_t nvec = n / kW;
  int64_t count = 0;
  for (int64_t i = 0; i < nvec; ++i) {
    const Vec xv = load_f(x + i * kW);
    count += compress_store(xv, (xv >= vlo) & (xv < vhi), out + count);
  }
  for (int64_t i = nvec * kW; i < n; ++i) {
    const float xi = static_cast<float>(x[i]);
    if (xi >= lo && xi < hi) out[count++] = xi;
  }
  return count;
}

// 2^w for w <= 0, ~2e-7 relative (w below -126 gives 0): the censuses' masses, cheaper than vexp (11 ops on
// AVX2 against about 20). AVX512: vexp2 (common.h); AVX2: its polynomial; portable: vexp.
inline Vec mass_exp2(const Vec& wv) {
#if defined(CPU_CAPABILITY_AVX512)
  return vexp2(wv);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 w = _mm256_max_ps(wv, _mm256_set1_ps(-127.f));  // 2^-127 and below: exponent field 0, value 0
  const __m256 n = _mm256_round_ps(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(w, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (size_t i = 1; i < std::size(kExp2Poly); ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
#else
  return vexp(wv * Vec(0.693147180559945309f));
#endif
}

// Probability masses e = exp((x - m) c) of the x >= lower of x[0..n): the total and, for each of G thresholds
// th[g] (>= lower), the mass of the x >= th[g]. fp32 lanes, added to double every kCensusFlush vectors.
template <int G, typename T>
inline double mass_census(const T* x, int64_t n, float lower, float m, float c, const float* th, double* above) {
  const Vec vlower(lower), vm(m), vc(static_cast<float>(c * 1.44269504088896341));  // base 2: mass_exp2
  Vec vth[G > 0 ? G : 1];
  for (int g = 0; g < G; ++g) {
    vth[g] = Vec(th[g]);
    above[g] = 0.0;
  }
  double total = 0.0;
  const int64_t nvec = n / kW, nall = (n + kW - 1) / kW;
  for (int64_t start = 0; start < nall; start += kCensusFlush) {
    const int64_t stop = std::min(nall, start + kCensusFlush);
    Vec acc_total(0.f), acc[G > 0 ? G : 1];
    for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
    for (int64_t i = start; i < stop; ++i) {
      const Vec xv = i < nvec ? load_f(x + i * kW) : load_tail(x, i * kW, n);
      const Vec e = mass_exp2((xv - vm) * vc) & (xv >= vlower);  // x = -inf: 0
      acc_total = acc_total + e;
      for (int g = 0; g < G; ++g) acc[g] = acc[g] + (e & (xv >= vth[g]));
    }
    total += lane_sum(acc_total);
    for (int g = 0; g < G; ++g) above[g] += lane_sum(acc[g]);
  }
  return total;
}

// Pass 1: the row max (NaN when the row has a NaN) and, with block > 0, the per-lane maxima of every block
// vectors appended to groups (padding lanes -inf).
template <typename T>
inline float scan_row(const T* x, int64_t V, int64_t block, std::vector<float>& groups) {
  const int64_t nvec = V / kW;
  Vec vmax_acc(-kInf), nan(0.f);
  groups.clear();
  auto add_group = [&](const Vec& gm) {
    const size_t at = groups.size();
    groups.resize(at + kW);
    gm.store(groups.data() + at);
  };
  const int64_t step = block > 0 ? block : nvec;
  for (int64_t start = 0; start < nvec; start += step) {
    const int64_t stop = std::min(nvec, start + step);
    Vec gm(-kInf);
    for (int64_t i = start; i < stop; ++i) {
      const Vec xv = load_f(x + i * kW);
      gm = vmax(gm, xv);
      nan = nan | (xv != xv);
    }
    vmax_acc = vmax(vmax_acc, gm);
    if (block > 0) add_group(gm);
  }
  if (V > nvec * kW) {
    const Vec xv = load_tail(x, nvec * kW, V);
    vmax_acc = vmax(vmax_acc, xv);
    nan = nan | (xv != xv);
    if (block > 0) add_group(xv);
  }
  alignas(64) float lanes[kW], nans[kW];
  vmax_acc.store(lanes);
  nan.store(nans);
  float m = -kInf;
  for (int64_t l = 0; l < kW; ++l) {
    if (nans[l] != 0.f) return kNaN;
    m = std::max(m, lanes[l]);
  }
  return m;
}

// The k-th largest of v[0..n) (1 <= k <= n); reorders v.
inline float kth_largest(float* v, int64_t n, int64_t k) {
  std::nth_element(v, v + (k - 1), v + n, std::greater<float>());
  return v[k - 1];
}

// The smallest and largest of v[0..n) (n >= 1).
inline std::pair<float, float> min_max(const float* v, int64_t n) {
  Vec lo(kInf), hi(-kInf);
  const int64_t nvec = n / kW;
  for (int64_t i = 0; i < nvec; ++i) {
    const Vec x = Vec::loadu(v + i * kW);
    lo = at::vec::minimum(lo, x);
    hi = at::vec::maximum(hi, x);
  }
  alignas(64) float a[kW], b[kW];
  lo.store(a);
  hi.store(b);
  float mn = kInf, mx = -kInf;
  for (int64_t l = 0; l < kW; ++l) {
    mn = std::min(mn, a[l]);
    mx = std::max(mx, b[l]);
  }
  for (int64_t i = nvec * kW; i < n; ++i) {
    mn = std::min(mn, v[i]);
    mx = std::max(mx, v[i]);
  }
  return {mn, mx};
}

// Top-p on candidates: the largest v among cand[0..n) whose mass above + the mass exp((x - m) c) of the cand >= v
// reaches goal (above: the mass of the kept logits larger than every candidate); cand is narrowed in place.
// Censuses at kCensus thresholds spaced evenly between the candidates' min and max drop the candidates outside
// the bracket holding the cut until at most kFewCandidates are left, which are sorted and scanned from the largest.
inline float select_mass(float* cand, int64_t n, float m, float c, double above, double goal) {
  float th[kCensus];
  double w[kCensus];
  n = gather_between(cand, n, kLowest, kInf, cand);  // -inf logits have no mass: never the cut
  while (n > kFewCandidates) {
    const auto [cmin, cmax] = min_max(cand, n);
    if (!(cmin < cmax)) return cmin;  // all equal: one tie, kept whole
    for (int g = 0; g < kCensus; ++g) {
      th[g] = static_cast<float>(cmax - (static_cast<double>(cmax) - cmin) * (g + 1) / (kCensus + 1));
    }
    mass_census<kCensus>(cand, n, -kInf, m, c, th, w);
    int g = 0;
    while (g < kCensus && above + w[g] < goal) ++g;
    const float lo = g < kCensus ? th[g] : cmin, hi = g > 0 ? th[g - 1] : kInf;
    const int64_t kept = gather_between(cand, n, lo, hi, cand);
    if (kept == n) break;  // no progress (thresholds that round together)
    n = kept;
    if (g > 0) above += w[g - 1];
  }
  std::sort(cand, cand + n, std::greater<float>());
  for (int64_t i = 0; i < n; ++i) {
    above += std::exp((static_cast<double>(cand[i]) - m) * c);
    if (above >= goal) return cand[i];
  }
  return n > 0 ? cand[n - 1] : -kInf;  // rounding: the census reached the goal, the candidates not quite
}

// The floor of one row (kltriton/kernels/truncation/__init__.py) and, in s.list[0..*kept), every logit >= it
// (none when the floor is -inf: nothing cut; or NaN: a NaN or +inf logit). t: the row's temperature.
template <typename T>
inline float row_floor(const T* x, int64_t V, double t, const Knobs& kn, TruncationScratch& s, int64_t* kept) {
  *kept = 0;
  const bool top_k = kn.k > 0 && kn.k < V, top_p = kn.p < 1.0, min_p = kn.min_p > 0.0;
  if (!top_k && !top_p && !min_p) return -kInf;
  const int64_t block = top_k ? std::max<int64_t>(1, V / (kGroupsPerK * kn.k)) : 0;  // V / block groups
  const float m = scan_row(x, V, block, s.groups);
  if (std::isnan(m) || m == kInf) return kNaN;
  if (m == -kInf) return -kInf;
  const float c = static_cast<float>(1.0 / t);
  float floor = min_p ? fp32_at_least(m + t * std::log(kn.min_p)) : -kInf;
  float start = floor;  // the list's threshold: at most the floor
  // top-p: its candidates lie in [cand_lo, cand_hi), the kept mass above them is `above`, the cut's goal `goal`
  float cand_lo = floor, cand_hi = kInf;
  double above = 0.0, goal = 0.0;
  if (top_k) {
    const int64_t groups = static_cast<int64_t>(s.groups.size());
    if (groups >= kn.k) start = std::max(start, kth_largest(s.groups.data(), groups, kn.k));
  } else if (top_p) {
    float th[kCensus];
    double w[kCensus];
    for (int g = 0; g < kCensus; ++g) th[g] = std::max(static_cast<float>(m - kCensusDepth[g] * t), floor);
    goal = kn.p * mass_census<kCensus>(x, V, floor, m, c, th, w);
    int g = 0;
    while (g < kCensus && w[g] < goal) ++g;
    if (g < kCensus) start = cand_lo = th[g];
    if (g > 0) {
      cand_hi = th[g - 1];
      above = w[g - 1];
    }
  }
  s.list.resize(V + kW + 1);
  const int64_t n = gather_between(x, V, start, kInf, s.list.data());
  if (top_k && n >= kn.k) floor = std::max(floor, kth_largest(s.list.data(), n, kn.k));
  if (top_p) {
    if (top_k) cand_lo = floor;  // top-p over the top-k kept set: the whole of it in the list
    s.cand.resize(n + kW);
    const int64_t nc = gather_between(s.list.data(), n, cand_lo, cand_hi, s.cand.data());
    if (top_k) goal = kn.p * mass_census<0>(s.cand.data(), nc, -kInf, m, c, nullptr, nullptr);
    floor = std::max(floor, select_mass(s.cand.data(), nc, m, c, above, goal));
  }
  *kept = n;
  return floor;
}

}  // namespace kltriton_cpp
