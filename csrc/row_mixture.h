// The divergence family's row kernels on the CPU (inline templates): the generalized JSD's second pass over a
// student row x and a teacher row y, given both whole rows' log-sum-exps (kltriton/kernels/divergence), and its
// gradient w.r.t. x. With log p = x / T - lse, log q = y / T - ref_lse and m = beta q + (1 - beta) p:
//   forward:  KL(p || m) = sum p (log p - log m),  KL(q || m) = sum q (log q - log m)
//   backward: grad = coef * p * (log p - log m - KL(p || m))
// Where the two sides agree (log p == log q) m equals them, and both terms are exactly 0 (not log p - log m, which
// rounds): identical distributions have a JSD of exactly 0 (the caller clamps the rounding of nearly identical
// ones to >= 0).
// An entry where p (q) is 0 adds no p (q) term, even where its ratio is inf or NaN. The terms are plain sums over
// the row, accumulated per SIMD lane and combined in double in a fixed order at the end of the row (an order that
// depends on V only). log p is formed as fma(x, lo, fma(x, hi, -lse)) with hi + lo = 1 / T (row_backward.h).
#pragma once

#include "common.h"

namespace kltriton_cpp {

// One row's parameters: 1 / T = hi + lo, the log-sum-exps, beta and 1 - beta.
struct MixtureRow {
  float hi, lo, lse, rlse, beta, one_minus_beta;
};

// p, q and log(p / m), log(q / m) of kW entries (a -inf logit: probability 0; both 0 where log p == log q).
struct MixtureVec {
  Vec p, q, p_over_m, q_over_m;
};

inline MixtureVec mixture_vec(const Vec& xraw, const Vec& yraw, const MixtureRow& k) {
  const Vec lowest(kLowest), vhi(k.hi), vlo(k.lo), nlse(-k.lse), nrlse(-k.rlse), zero(0.f);
  const Vec xv = at::vec::clamp_min(xraw, lowest), yv = at::vec::clamp_min(yraw, lowest);
  const Vec log_p = vfma(xv, vlo, vfma(xv, vhi, nlse));
  const Vec log_q = vfma(yv, vlo, vfma(yv, vhi, nrlse));
  MixtureVec e;
  e.p = vexp(log_p);
  e.q = vexp(log_q);
  const Vec log_m = at::vec::fmadd(Vec(k.beta), e.q, Vec(k.one_minus_beta) * e.p).log();
  const Vec agree = log_p == log_q;
  e.p_over_m = Vec::blendv(log_p - log_m, zero, agree);
  e.q_over_m = Vec::blendv(log_q - log_m, zero, agree);
  return e;
}

// prob * c, or 0 where prob == 0.
inline Vec mul_where_pos(const Vec& prob, const Vec& c) {
  const Vec zero(0.f);
  return Vec::blendv(prob * c, zero, prob == zero);
}

// kW entries of a row as floats, -inf past `count` (the row's tail).
template <typename T>
inline Vec load_tail(const T* p, int64_t count) {
  alignas(64) float buf[kW];
  for (int64_t l = 0; l < kW; ++l) buf[l] = l < count ? static_cast<float>(p[l]) : -kInf;
  return Vec::loadu(buf);
}

// {KL(p || m), KL(q || m)} of one row.
template <typename T, typename R>
inline std::pair<double, double> jsd_forward_row(const T* x, const R* y, int64_t V, const MixtureRow& k) {
  const Vec zero(0.f);
  Vec kl_p[2] = {zero, zero}, kl_q[2] = {zero, zero};
  auto step = [&](const Vec& xv, const Vec& yv, int j) {
    const MixtureVec e = mixture_vec(xv, yv, k);
    kl_p[j] = kl_p[j] + mul_where_pos(e.p, e.p_over_m);
    kl_q[j] = kl_q[j] + mul_where_pos(e.q, e.q_over_m);
  };
  int64_t v = 0;
  for (; v + 2 * kW <= V; v += 2 * kW) {
    step(load_f(x + v), load_f(y + v), 0);
    step(load_f(x + v + kW), load_f(y + v + kW), 1);
  }
  for (; v < V; v += kW) step(load_tail(x + v, V - v), load_tail(y + v, V - v), 0);
  alignas(64) float a0[kW], a1[kW], b0[kW], b1[kW];
  kl_p[0].store(a0);
  kl_p[1].store(a1);
  kl_q[0].store(b0);
  kl_q[1].store(b1);
  double sp = 0.0, sq = 0.0;
  for (int64_t l = 0; l < kW; ++l) {
    sp += static_cast<double>(a0[l]) + a1[l];
    sq += static_cast<double>(b0[l]) + b1[l];
  }
  return {sp, sq};
}

// The row's gradient coef * p * (log p - log m - kl_student), written in the logits dtype.
template <typename T, typename R>
inline void jsd_backward_row(const T* x, const R* y, T* g, int64_t V, const MixtureRow& k, float kl_student,
                             float coef) {
  const Vec vkl(kl_student), vcoef(coef);
  auto grad_vec = [&](const Vec& xv, const Vec& yv) {
    const MixtureVec e = mixture_vec(xv, yv, k);
    return vcoef * mul_where_pos(e.p, e.p_over_m - vkl);
  };
  int64_t v = 0;
  for (; v + 2 * kW <= V; v += 2 * kW) {
    Vec x0, x1, y0, y1;
    load_f2(x + v, x0, x1);
    load_f2(y + v, y0, y1);
    store_f2(g + v, grad_vec(x0, y0), grad_vec(x1, y1));
  }
  for (; v < V; v += kW) {
    alignas(64) float out[kW];
    grad_vec(load_tail(x + v, V - v), load_tail(y + v, V - v)).store(out);
    for (int64_t l = 0; l < kW && v + l < V; ++l) g[v + l] = static_cast<T>(out[l]);
  }
}

}  // namespace kltriton_cpp
