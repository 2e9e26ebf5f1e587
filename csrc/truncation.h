// The truncation family's floor on the CPU (inline templates): per row, the smallest logit that vLLM v1's
// min-p, top-k and top-p (in that order) keep, found by selection without sorting the row
// (kltriton/kernels/truncation/__init__.py states the semantics). The statistics of the kept set are then
// forward_row / backward_row with FLOOR (row_forward.h, row_backward.h).
//
// Passes over a row of V logits (each a read of V elements; after the first, from L2 when the row fits):
//   1. the row max m (min-p's threshold m + T log(min_p) follows);
//   2. per step (top-k, then top-p): a census: for kThresholds thresholds m - T d_g (d_g = 4^(g-1): 0.25 ... 4096
//      nats below the max, with the lower bound so far) the count (top-k) or probability mass exp((x - m) / T)
//      (top-p) of the kept logits >= each threshold; the bracket between two thresholds where it reaches the
//      goal (k, or top_p times the kept mass) holds the cut;
//   3. per step: the logits inside that bracket are copied to a candidate list; the list is narrowed by censuses
//      over the list alone (linear thresholds) to at most kFewCandidates, which are sorted (the candidates, never
//      the row) and scanned from the largest;
//   then the statistics pass over the kept set (forward_row with FLOOR).
// min-p alone: 2 passes; top-k or top-p: 4; all three: 6.
#pragma once

#include <algorithm>
#include <functional>

#include "common.h"

namespace kltriton_cpp {

constexpr int kThresholds = 8;         // census thresholds per pass
constexpr size_t kFewCandidates = 256;  // candidates sorted at the end

// The row's knobs: k (0 off), p (1 off), min_p (0 off).
struct Knobs {
  int64_t k;
  double p, min_p;
};

// The smallest fp32 >= value (so that x >= result in fp32 iff x >= value for fp32 x).
inline float fp32_at_least(double value) {
  float f = static_cast<float>(value);
  if (static_cast<double>(f) < value) f = std::nextafter(f, kInf);
  return f;
}

// One step's selection: the largest value v >= lower whose weight over {x >= v, x >= lower} reaches the goal, the
// weight of a logit x being 1 (MASS false) or exp((x - m) * c) (MASS true); goal = k, or top_p times the weight
// of {x >= lower}. Returns lower when the whole kept set does not reach k.
template <typename T, bool MASS>
inline float select_floor(const T* x, int64_t V, float m, double c, float lower, double goal_arg,
                          std::vector<float>& cand) {
  const double t = 1.0 / c;
  float th[kThresholds];
  for (int g = 0; g < kThresholds; ++g) {
    const double d = std::ldexp(1.0, 2 * g - 2);  // 0.25, 1, 4, ..., 4096 (in units of T)
    th[g] = std::max(static_cast<float>(m - d * t), lower);
  }
  // Census over the row.
  const Vec vlower(lower), zero(0.f), one(1.f), vm(m), vc(static_cast<float>(c));
  Vec total(0.f), acc[kThresholds];
  Vec vth[kThresholds];
  for (int g = 0; g < kThresholds; ++g) {
    acc[g] = zero;
    vth[g] = Vec(th[g]);
  }
  auto census = [&](const Vec& xv) {
    const Vec kept = xv >= vlower;
    Vec w;
    if constexpr (MASS) {
      w = Vec::blendv(zero, vexp((xv - vm) * vc), kept);
    } else {
      w = Vec::blendv(zero, one, kept);
    }
    total = total + w;
    for (int g = 0; g < kThresholds; ++g) acc[g] = acc[g] + Vec::blendv(zero, w, xv >= vth[g]);
  };
  const int64_t nvec = V / kW;
  for (int64_t i = 0; i < nvec; ++i) census(load_f(x + i * kW));
  if (V > nvec * kW) {
    alignas(64) float tail[kW];
    for (int64_t l = 0; l < kW; ++l) tail[l] = nvec * kW + l < V ? static_cast<float>(x[nvec * kW + l]) : -kInf;
    census(Vec::loadu(tail));
  }
  auto lanes = [](const Vec& v) {
    alignas(64) float a[kW];
    v.store(a);
    double s = 0.0;
    for (int64_t l = 0; l < kW; ++l) s += a[l];
    return s;
  };
  const double all = lanes(total);
  const double goal = MASS ? goal_arg * all : goal_arg;
  if (!(all >= goal)) return lower;  // fewer than k kept (or no mass): the step keeps everything
  // The bracket [lo, hi) holding the cut; `above` is the weight of {x >= hi}.
  double above = 0.0;
  float hi = kInf, lo = lower;
  for (int g = 0; g < kThresholds; ++g) {
    const double w = lanes(acc[g]);
    if (w >= goal) {
      lo = th[g];
      break;
    }
    above = w;
    hi = th[g];
  }
  // Candidates: the logits in [lo, hi).
  cand.clear();
  const Vec vlo(lo), vhi(hi);
  for (int64_t i = 0; i < nvec; ++i) {
    const Vec xv = load_f(x + i * kW);
    const Vec in = (xv >= vlo) & (xv < vhi);
    if (in.zero_mask() == (1 << kW) - 1) continue;  // no lane inside
    for (int64_t l = 0; l < kW; ++l) {
      const float xi = static_cast<float>(x[i * kW + l]);
      if (xi >= lo && xi < hi) cand.push_back(xi);
    }
  }
  for (int64_t v = nvec * kW; v < V; ++v) {
    const float xi = static_cast<float>(x[v]);
    if (xi >= lo && xi < hi) cand.push_back(xi);
  }
  auto weight = [&](float xi) { return MASS ? std::exp((static_cast<double>(xi) - m) * c) : 1.0; };
  // Narrow the candidates: linear thresholds between their min and max.
  while (cand.size() > kFewCandidates) {
    const auto [mn, mx] = std::minmax_element(cand.begin(), cand.end());
    const float cmin = *mn, cmax = *mx;
    if (!(cmin < cmax)) break;
    float sub[kThresholds];
    double w[kThresholds] = {};
    for (int g = 0; g < kThresholds; ++g) {
      sub[g] = static_cast<float>(cmax - (cmax - static_cast<double>(cmin)) * (g + 1) / (kThresholds + 1));
    }
    for (float xi : cand) {
      const double wi = weight(xi);
      for (int g = 0; g < kThresholds; ++g) w[g] += xi >= sub[g] ? wi : 0.0;
    }
    float nlo = cmin, nhi = kInf;
    double nabove = above;
    for (int g = 0; g < kThresholds; ++g) {
      if (above + w[g] >= goal) {
        nlo = sub[g];
        break;
      }
      nabove = above + w[g];
      nhi = sub[g];
    }
    const size_t before = cand.size();
    cand.erase(std::remove_if(cand.begin(), cand.end(), [&](float xi) { return !(xi >= nlo && xi < nhi); }),
               cand.end());
    above = nabove;
    if (cand.size() == before) break;  // no progress (rounding of the thresholds)
  }
  std::sort(cand.begin(), cand.end(), std::greater<float>());
  double cum = above;
  for (float xi : cand) {
    cum += weight(xi);
    if (cum >= goal) return xi;
  }
  return cand.empty() ? lo : cand.back();  // rounding: the census reached the goal, the candidates not quite
}

// The floor of one row (kltriton/kernels/truncation/__init__.py): NaN for a NaN or +inf logit, -inf for an all
// -inf row or when nothing is cut. t: the row's temperature.
template <typename T>
inline float row_floor(const T* x, int64_t V, double t, const Knobs& kn, std::vector<float>& cand) {
  Vec vmax_acc(-kInf);
  bool nan = false;
  const int64_t nvec = V / kW;
  for (int64_t i = 0; i < nvec; ++i) {
    const Vec xv = load_f(x + i * kW);
    vmax_acc = vmax(vmax_acc, xv);
    nan |= (xv != xv).zero_mask() != (1 << kW) - 1;
  }
  alignas(64) float lanes[kW];
  vmax_acc.store(lanes);
  float m = -kInf;
  for (int64_t l = 0; l < kW; ++l) m = std::max(m, lanes[l]);
  for (int64_t v = nvec * kW; v < V; ++v) {
    const float xi = static_cast<float>(x[v]);
    nan |= xi != xi;
    m = std::max(m, xi);
  }
  if (nan || m == kInf) return kNaN;
  if (m == -kInf) return -kInf;
  float lower = kn.min_p > 0.0 ? fp32_at_least(m + t * std::log(kn.min_p)) : -kInf;
  const double c = 1.0 / t;
  if (kn.k > 0 && kn.k < V) {
    lower = std::max(lower, select_floor<T, false>(x, V, m, c, lower, static_cast<double>(kn.k), cand));
  }
  if (kn.p < 1.0) lower = std::max(lower, select_floor<T, true>(x, V, m, c, lower, kn.p, cand));
  return lower;
}

}  // namespace kltriton_cpp
