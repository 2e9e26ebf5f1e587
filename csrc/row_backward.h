// The backward row kernel of the C++ CPU backend (inline templates): the gradient w.r.t. one row of
// logits on the basis of kltriton/kernels/constants.py GRADIENT_BASIS,
//   grad = c_label * onehot(label) - p * (c_p + c_p_logp * log p + c_p_logq * log q) - c_q * q,
// written directly into the row's gradient in the logits dtype (no [N, V] temporaries). The
// coefficients are already divided by T (kltriton/kernels/statistics.py gradient_basis turns the
// statistics' upstream gradients into them; loss_coefficients.h does it per row for the loss).
// log p = x / T - lse is formed as fma(x, lo, fma(x, hi, -lse)) with hi + lo = 1 / T, so the
// cancellation against lse keeps full fp32 precision even for logits of magnitude 1e4.
#pragma once

#include "common.h"

#include <cstring>

namespace kltriton_cpp {

// A backward variant: the optional terms of the gradient basis it evaluates (label and p always), and the index of
// each term in a stacked basis (kltriton/kernels/constants.py GRADIENT_BASIS).
enum BasisBit : int { kPLogp = KLTRITON_BASIS_P_LOGP_BIT, kPLogq = KLTRITON_BASIS_P_LOGQ_BIT, kQ = KLTRITON_BASIS_Q_BIT };
constexpr int kNumBasis = KLTRITON_NUM_BASIS;
constexpr int kBasisLimit = KLTRITON_BASIS_LIMIT;
// The backward variants, by whether they read a reference row.
template <int M>
struct ReadsReference : std::bool_constant<(M & KLTRITON_BASIS_NEEDS_REF) != 0> {};
template <int M>
struct IgnoresReference : std::bool_constant<(M & KLTRITON_BASIS_NEEDS_REF) == 0> {};

// One row's gradient coefficients: 1 / T = hi + lo, the log-sum-exps, and the basis.
struct RowCoef {
  float hi, lo, lse, rlse, label, p, p_logp, p_logq, q;
};

// The row coefficients of row n from basis values that are already divided by T.
inline RowCoef row_coef(const Temperatures& temp, int64_t n, float lse, float rlse, float label, float p,
                        float p_logp, float p_logq, float q = 0.f) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  return RowCoef{hi, static_cast<float>(lo), lse, rlse, label, p, p_logp, p_logq, q};
}

// The same from a stacked basis: basis[i] the i-th term's [N] values (nullptr: absent, 0).
inline RowCoef row_coef(const Temperatures& temp, int64_t n, float lse, float rlse, const float* const* basis) {
  const auto term = [&](int i) { return basis[i] != nullptr ? basis[i][n] : 0.f; };
  return row_coef(temp, n, lse, rlse, term(KLTRITON_BASIS_LABEL), term(KLTRITON_BASIS_P),
                  term(KLTRITON_BASIS_P_LOGP), term(KLTRITON_BASIS_P_LOGQ), term(KLTRITON_BASIS_Q));
}

// MODE bits (BasisBit): kPLogp adds c_p_logp * log p, kPLogq adds c_p_logq * log q, kQ subtracts c_q * q (both
// read the reference row). Without any, the gradient is -p * c_p (plus the label term).
template <int MODE>
inline float grad_scalar(float x, float y, const RowCoef& k) {
  // Clamp -inf to the lowest finite value: lo may be negative, and -inf * lo + -inf is NaN.
  x = std::max(x, kLowest);
  y = std::max(y, kLowest);
  const float lp = std::fma(x, k.lo, std::fma(x, k.hi, -k.lse));
  const float lq = (MODE & (kPLogq | kQ)) ? std::fma(y, k.lo, std::fma(y, k.hi, -k.rlse)) : 0.f;
  const float p = std::exp(lp);
  float out;
  if constexpr ((MODE & (kPLogp | kPLogq)) == 0) {
    out = -p * k.p;
  } else {
    float c = k.p;
    if constexpr (MODE & kPLogp) c = std::fma(k.p_logp, lp, c);
    if constexpr (MODE & kPLogq) c = std::fma(k.p_logq, lq, c);
    out = p == 0.f ? 0.f : -p * c;  // p == 0 where x = -inf: no mass, no gradient
  }
  if constexpr (MODE & kQ) out = std::fma(-k.q, std::exp(lq), out);
  return out;
}

// FLOOR (the truncation family): the logits below `floor` are read as -inf (p = 0, no gradient there).
// ADD: g += the row's gradient instead of g = (the entropy mask's last pass, loss_forward.cpp).
template <typename T, typename R, int MODE, bool FLOOR = false, bool ADD = false>
inline void backward_row(const T* x, const R* y, T* g, int64_t V, int64_t label, const RowCoef& k,
                         float floor = -kInf) {
  constexpr bool READS_Y = (MODE & (kPLogq | kQ)) != 0;
  const float g_label = ADD ? static_cast<float>(g[label]) : 0.f;
  const float x_label = static_cast<float>(x[label]);  // read first: g may be x itself (a gradient in place)
  const Vec vhi(k.hi), vlo(k.lo), nlse(-k.lse), nrlse(-k.rlse), vA(k.p), vB(k.p_logp), vC(k.p_logq), vQ(k.q);
  const Vec zero(0.f), nA(-k.p), lowest(kLowest), vfloor(floor), vninf(-kInf);
  auto grad_vec = [&](const Vec& xin, const Vec& yraw) -> Vec {
    Vec xraw = xin;
    if constexpr (FLOOR) xraw = Vec::blendv(xin, vninf, xin < vfloor);
    // x = -inf -> lowest: log p overflows to -inf and p = 0 (-inf * lo + -inf could be NaN).
    const Vec xv = at::vec::clamp_min(xraw, lowest);
    const Vec lp = vfma(xv, vlo, vfma(xv, vhi, nlse));
    const Vec p = vexp(lp);
    Vec lq = zero;
    if constexpr (READS_Y) {
      const Vec yv = at::vec::clamp_min(yraw, lowest);
      lq = vfma(yv, vlo, vfma(yv, vhi, nrlse));
    }
    Vec out;
    if constexpr ((MODE & (kPLogp | kPLogq)) == 0) {
      out = p * nA;
    } else {
      Vec c = vA;
      if constexpr (MODE & kPLogp) c = at::vec::fmadd(vB, lp, c);
      if constexpr (MODE & kPLogq) c = at::vec::fmadd(vC, lq, c);
      out = neg_mul_where_pos(p, c);
    }
    if constexpr (MODE & kQ) out = out - vQ * vexp(lq);
    return out;
  };
  constexpr int64_t step = 2 * kW;
  int64_t v = 0;
  for (; v + step <= V; v += step) {
    Vec x0, x1, y0 = zero, y1 = zero;
    load_f2(x + v, x0, x1);
    if constexpr (READS_Y) load_f2(y + v, y0, y1);
    if constexpr (ADD) {
      Vec g0, g1;
      load_f2(g + v, g0, g1);
      store_f2(g + v, g0 + grad_vec(x0, y0), g1 + grad_vec(x1, y1));
    } else {
      store_f2(g + v, grad_vec(x0, y0), grad_vec(x1, y1));
    }
  }
  if (v < V) {
    // The tail through the same vector code, padded with -inf (p = 0): an entry's gradient has the same bits
    // wherever the row ends or its label is (vocab shards, LinearLogits tiles: the invariant mode relies on it).
    const int64_t rem = V - v;
    alignas(64) float bx[step], by[step], bg[step];
    for (int64_t l = 0; l < step; ++l) {
      bx[l] = l < rem ? static_cast<float>(x[v + l]) : -kInf;
      by[l] = (READS_Y && l < rem) ? static_cast<float>(y[v + l]) : -kInf;
    }
    grad_vec(Vec::loadu(bx), Vec::loadu(by)).store(bg);
    grad_vec(Vec::loadu(bx + kW), Vec::loadu(by + kW)).store(bg + kW);
    for (int64_t l = 0; l < rem; ++l) {
      const float before = ADD ? static_cast<float>(g[v + l]) : 0.f;
      g[v + l] = static_cast<T>(before + bg[l]);
    }
  }
  // The label's entry: its p terms by the same vector code (every lane computes the same), plus the label term.
  const float yl = READS_Y ? static_cast<float>(y[label]) : 0.f;
  alignas(64) float at_label[kW];
  grad_vec(Vec(x_label), Vec(yl)).store(at_label);
  g[label] = static_cast<T>(g_label + k.label + at_label[0]);
}

// backward_row from the forward's exponentials (the fused loss, loss_forward.cpp): p = e[v] * scale[b * kW + l]
// for element v in lane l of block b (block_len elements each), scale = exp(frame / T - lse) of that block's lane
// frame (ExpCache, row_forward.h), so the gradient pass computes no exponential per element; log p (for the
// p_logp / p_logq terms) is formed from x and lse as in backward_row. e and scale are padded to whole vectors.
template <typename T, typename R, int MODE>
inline void backward_row_cached(const T* x, const R* y, T* g, int64_t V, int64_t label, const RowCoef& k,
                                const float* e, const float* scale, int64_t block_len) {
  const Vec vhi(k.hi), vlo(k.lo), nlse(-k.lse), nrlse(-k.rlse), vA(k.p), vB(k.p_logp), vC(k.p_logq);
  const Vec nA(-k.p), lowest(kLowest);
  auto grad_vec = [&](const Vec& p, const Vec& xraw, const Vec& yraw) -> Vec {
    if constexpr (MODE == 0) {
      return p * nA;
    } else {
      Vec c = vA;
      if constexpr (MODE & kPLogp) {
        const Vec xv = at::vec::clamp_min(xraw, lowest);
        c = at::vec::fmadd(vB, vfma(xv, vlo, vfma(xv, vhi, nlse)), c);
      }
      if constexpr (MODE & kPLogq) {
        const Vec yv = at::vec::clamp_min(yraw, lowest);
        c = at::vec::fmadd(vC, vfma(yv, vlo, vfma(yv, vhi, nrlse)), c);
      }
      return neg_mul_where_pos(p, c);
    }
  };
  auto grad_one = [&](int64_t v, float p) -> float {  // the same for one element
    if constexpr (MODE == 0) {
      return -p * k.p;
    } else {
      float c = k.p;
      if constexpr (MODE & kPLogp) {
        const float xv = std::max(static_cast<float>(x[v]), kLowest);
        c = std::fma(k.p_logp, std::fma(xv, k.lo, std::fma(xv, k.hi, -k.lse)), c);
      }
      if constexpr (MODE & kPLogq) {
        const float yv = std::max(static_cast<float>(y[v]), kLowest);
        c = std::fma(k.p_logq, std::fma(yv, k.lo, std::fma(yv, k.hi, -k.rlse)), c);
      }
      return p == 0.f ? 0.f : -p * c;
    }
  };
  // The forward's blocks: block_len elements up to the last whole vector, then the tail's own block. The row's
  // gradient is written with streaming stores where the row is aligned for them (stream_f2).
  const Vec zero(0.f);
  const int64_t whole = V / kW * kW;
  const bool stream = streamable(g);
  for (int64_t start = 0, b = 0; start < V; ++b) {
    const int64_t end = start < whole ? std::min(start + block_len, whole) : V;
    const Vec sc = Vec::loadu(scale + b * kW);
    int64_t v = start;
    for (; v + 2 * kW <= end; v += 2 * kW) {
      Vec x0 = zero, x1 = zero, y0 = zero, y1 = zero;
      if constexpr (MODE & kPLogp) load_f2(x + v, x0, x1);
      if constexpr (MODE & kPLogq) load_f2(y + v, y0, y1);
      const Vec g0 = grad_vec(Vec::loadu(e + v) * sc, x0, y0), g1 = grad_vec(Vec::loadu(e + v + kW) * sc, x1, y1);
      if (stream) {
        stream_f2(g + v, g0, g1);
      } else {
        store_f2(g + v, g0, g1);
      }
    }
    for (; v < end; ++v) g[v] = static_cast<T>(grad_one(v, e[v] * scale[b * kW + (v - start) % kW]));
    start = end;
  }
  const float yl = (MODE & kPLogq) ? static_cast<float>(y[label]) : 0.f;
  g[label] = static_cast<T>(k.label + grad_scalar<MODE>(static_cast<float>(x[label]), yl, k));
}

// A zero gradient row (a skipped row, or one without a finite lse).
template <typename T>
inline void zero_row(T* g, int64_t V) {
  std::memset(static_cast<void*>(g), 0, sizeof(T) * V);
}

}  // namespace kltriton_cpp
