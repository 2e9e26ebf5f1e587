// The backward row kernel of the C++ CPU backend (inline templates): the gradient w.r.t. one row of
// logits on the basis of kltriton/kernels/constants.py GRADIENT_BASIS,
//   grad = c_label * onehot(label) - p * (c_p + c_p_logp * log p + c_p_logq * log q),
// written directly into the row's gradient in the logits dtype (no [N, V] temporaries). The
// coefficients are already divided by T (kltriton/kernels/statistics.py gradient_basis turns the
// statistics' upstream gradients into them; loss_coefficients.h does it per row for the loss).
// log p = x / T - lse is formed as fma(x, lo, fma(x, hi, -lse)) with hi + lo = 1 / T, so the
// cancellation against lse keeps full fp32 precision even for logits of magnitude 1e4.
#pragma once

#include "common.h"

#include <cstring>

namespace kltriton_cpp {

// One row's gradient coefficients: 1 / T = hi + lo, the log-sum-exps, and the basis.
struct RowCoef {
  float hi, lo, lse, rlse, label, p, p_logp, p_logq;
};

// The row coefficients of row n from basis values that are already divided by T.
inline RowCoef row_coef(const Temperatures& temp, int64_t n, float lse, float rlse, float label, float p,
                        float p_logp, float p_logq) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  return RowCoef{hi, static_cast<float>(lo), lse, rlse, label, p, p_logp, p_logq};
}

// MODE bits (BasisBit): kPLogp adds c_p_logp * log p, kPLogq adds c_p_logq * log q and reads the
// reference row. Without either, the gradient is -p * c_p (plus the label term).
template <int MODE>
inline float grad_scalar(float x, float y, const RowCoef& k) {
  // Clamp -inf to the lowest finite value: lo may be negative, and -inf * lo + -inf is NaN.
  x = std::max(x, kLowest);
  y = std::max(y, kLowest);
  const float lp = std::fma(x, k.lo, std::fma(x, k.hi, -k.lse));
  const float p = std::exp(lp);
  if constexpr (MODE == 0) {
    return -p * k.p;
  } else {
    float c = k.p;
    if constexpr (MODE & kPLogp) c = std::fma(k.p_logp, lp, c);
    if constexpr (MODE & kPLogq) {
      const float lq = std::fma(y, k.lo, std::fma(y, k.hi, -k.rlse));
      c = std::fma(k.p_logq, lq, c);
    }
    return p == 0.f ? 0.f : -p * c;  // p == 0 where x = -inf: no mass, no gradient
  }
}

// ADD: g += the row's gradient instead of g = (the entropy mask's last pass, loss_forward.cpp).
template <typename T, typename R, int MODE, bool ADD = false>
inline void backward_row(const T* x, const R* y, T* g, int64_t V, int64_t label, const RowCoef& k) {
  const float g_label = ADD ? static_cast<float>(g[label]) : 0.f;
  const Vec vhi(k.hi), vlo(k.lo), nlse(-k.lse), nrlse(-k.rlse), vA(k.p), vB(k.p_logp), vC(k.p_logq);
  const Vec zero(0.f), nA(-k.p), lowest(kLowest);
  auto grad_vec = [&](const Vec& xraw, const Vec& yraw) -> Vec {
    // x = -inf -> lowest: log p overflows to -inf and p = 0 (-inf * lo + -inf could be NaN).
    const Vec xv = at::vec::clamp_min(xraw, lowest);
    const Vec lp = vfma(xv, vlo, vfma(xv, vhi, nlse));
    const Vec p = vexp(lp);
    if constexpr (MODE == 0) {
      return p * nA;
    } else {
      Vec c = vA;
      if constexpr (MODE & kPLogp) c = at::vec::fmadd(vB, lp, c);
      if constexpr (MODE & kPLogq) {
        const Vec yv = at::vec::clamp_min(yraw, lowest);
        const Vec lq = vfma(yv, vlo, vfma(yv, vhi, nrlse));
        c = at::vec::fmadd(vC, lq, c);
      }
      return neg_mul_where_pos(p, c);
    }
  };
  constexpr int64_t step = 2 * kW;
  int64_t v = 0;
  for (; v + step <= V; v += step) {
    Vec x0, x1, y0 = zero, y1 = zero;
    load_f2(x + v, x0, x1);
    if constexpr (MODE & kPLogq) load_f2(y + v, y0, y1);
    if constexpr (ADD) {
      Vec g0, g1;
      load_f2(g + v, g0, g1);
      store_f2(g + v, g0 + grad_vec(x0, y0), g1 + grad_vec(x1, y1));
    } else {
      store_f2(g + v, grad_vec(x0, y0), grad_vec(x1, y1));
    }
  }
  for (; v < V; ++v) {
    const float yv = (MODE & kPLogq) ? static_cast<float>(y[v]) : 0.f;
    const float before = ADD ? static_cast<float>(g[v]) : 0.f;
    g[v] = static_cast<T>(before + grad_scalar<MODE>(static_cast<float>(x[v]), yv, k));
  }
  const float yl = (MODE & kPLogq) ? static_cast<float>(y[label]) : 0.f;
  g[label] = static_cast<T>(g_label + k.label + grad_scalar<MODE>(static_cast<float>(x[label]), yl, k));
}

// A zero gradient row (a skipped row, or one without a finite lse).
template <typename T>
inline void zero_row(T* g, int64_t V) {
  std::memset(static_cast<void*>(g), 0, sizeof(T) * V);
}

}  // namespace kltriton_cpp
