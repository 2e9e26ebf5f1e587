// Backward of the kltriton C++ CPU backend: the gradient w.r.t. the logits of
//   sum_n g_logp[n] * logp[n] + g_entropy[n] * entropy[n] + g_full_kl[n] * full_kl[n]
// written directly into an [N, V] tensor of the logits dtype (no [N, V] temporaries):
//   grad = invT * (g_logp * (onehot - p) - g_ent * p * (log p + H) + g_kl * p * (log p - log q - KL))
//        = invT * g_logp * onehot - p * (A + B * log p + C * log q)
// with A = invT * (g_logp + g_ent * H + g_kl * KL), B = invT * (g_ent - g_kl), C = invT * g_kl.
// log p = x / T - lse is formed as fma(x, lo, fma(x, hi, -lse)) with hi + lo = 1 / T, so the
// cancellation against lse keeps full fp32 precision even for logits of magnitude 1e4.
#include "stream_common.h"

#include <cstring>

namespace kltriton_cpp {
namespace {

struct RowCoef {
  float hi, lo, lse, rlse, A, B, C, gl_inv;
};

// MODE bits (stream_common.h): kEntropy adds the entropy term, kFullKl (with kRef) the full-KL term
// and reads the reference row. Without either, the gradient is -p * A (plus the label term).
template <int MODE>
inline float grad_scalar(float x, float y, const RowCoef& k) {
  // Clamp -inf to the lowest finite value: lo may be negative, and -inf * lo + -inf is NaN.
  x = std::max(x, kLowest);
  y = std::max(y, kLowest);
  const float lp = std::fma(x, k.lo, std::fma(x, k.hi, -k.lse));
  const float p = std::exp(lp);
  if constexpr (MODE == 0) {
    return -p * k.A;
  } else {
    float c = std::fma(k.B, lp, k.A);
    if constexpr (MODE & kFullKl) {
      const float lq = std::fma(y, k.lo, std::fma(y, k.hi, -k.rlse));
      c = std::fma(k.C, lq, c);
    }
    return p == 0.f ? 0.f : -p * c;  // p == 0 where x = -inf: no mass, no gradient
  }
}

// The coefficients of row n's gradient for upstream gradients gl (log-prob), ge (entropy H) and
// gk (full KL K); lse / rlse are the row's policy / reference log-sum-exp.
inline RowCoef row_coef(const Temperatures& temp, int64_t n, float lse, float rlse, float gl, float ge, float H,
                        float gk, float K) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  const double inv = static_cast<double>(hi) + lo;
  RowCoef k;
  k.hi = hi;
  k.lo = static_cast<float>(lo);
  k.lse = lse;
  k.rlse = rlse;
  const double A = static_cast<double>(gl) + (ge != 0.f ? double(ge) * H : 0.0) +
                   (gk != 0.f ? double(gk) * K : 0.0);
  k.A = static_cast<float>(inv * A);
  k.B = static_cast<float>(inv * (double(ge) - double(gk)));
  k.C = static_cast<float>(inv * gk);
  k.gl_inv = static_cast<float>(inv * gl);
  return k;
}

template <typename T, typename R, int MODE>
void backward_row(const T* x, const R* y, T* g, int64_t V, int64_t label, const RowCoef& k) {
  const Vec vhi(k.hi), vlo(k.lo), nlse(-k.lse), nrlse(-k.rlse), vA(k.A), vB(k.B), vC(k.C);
  const Vec zero(0.f), nA(-k.A), lowest(kLowest);
  auto grad_vec = [&](const Vec& xraw, const Vec& yraw) -> Vec {
    // x = -inf -> lowest: log p overflows to -inf and p = 0 (-inf * lo + -inf could be NaN).
    const Vec xv = at::vec::clamp_min(xraw, lowest);
    const Vec lp = vfma(xv, vlo, vfma(xv, vhi, nlse));
    const Vec p = vexp(lp);
    if constexpr (MODE == 0) {
      return p * nA;
    } else {
      Vec c = at::vec::fmadd(vB, lp, vA);
      if constexpr (MODE & kFullKl) {
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
    if constexpr (MODE & kFullKl) load_f2(y + v, y0, y1);
    store_f2(g + v, grad_vec(x0, y0), grad_vec(x1, y1));
  }
  for (; v < V; ++v) {
    const float yv = (MODE & kFullKl) ? static_cast<float>(y[v]) : 0.f;
    g[v] = static_cast<T>(grad_scalar<MODE>(static_cast<float>(x[v]), yv, k));
  }
  const float yl = (MODE & kFullKl) ? static_cast<float>(y[label]) : 0.f;
  g[label] = static_cast<T>(k.gl_inv + grad_scalar<MODE>(static_cast<float>(x[label]), yl, k));
}

struct Inputs {
  const int64_t* tgt;
  const float *lse, *rlse, *gl, *ge, *ent, *gk, *kl;
};

template <typename T, typename R, int MODE>
void run_backward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                  const Inputs& in, at::Tensor& grad, const Temperatures& temp) {
  const int64_t N = grad.size(0), V = grad.size(1);
  const Rows3d X(logits3d);
  const Rows3d Y = (MODE & kFullKl) ? Rows3d(*ref3d) : Rows3d();
  T* gbase = grad.data_ptr<T>();
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* g = gbase + n * V;
      const int64_t tg = in.tgt[n];
      const float lse = in.lse[n];
      if (tg < 0 || tg >= V || !std::isfinite(lse)) {
        std::memset(static_cast<void*>(g), 0, sizeof(T) * V);
        continue;
      }
      const float gl = in.gl[n];
      const float ge = (MODE & kEntropy) ? in.ge[n] : 0.f;
      const float H = (MODE & kEntropy) ? in.ent[n] : 0.f;
      const float gk = (MODE & kFullKl) ? in.gk[n] : 0.f;
      const float K = (MODE & kFullKl) ? in.kl[n] : 0.f;
      const RowCoef k = row_coef(temp, n, lse, (MODE & kFullKl) ? in.rlse[n] : 0.f, gl, ge, H, gk, K);
      backward_row<T, R, MODE>(X.row<T>(n), (MODE & kFullKl) ? Y.row<R>(n) : nullptr, g, V, tg, k);
    }
  });
}

at::Tensor as_f32_vec(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  TORCH_CHECK(t.has_value(), "kltriton_cpp: ", name, " is required");
  TORCH_CHECK(t->numel() == N, "kltriton_cpp: ", name, " must have one entry per row");
  return t->to(at::kFloat).contiguous();
}

}  // namespace

#ifndef KLTRITON_ROW_KERNELS_ONLY
at::Tensor stream_backward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                           const at::Tensor& target, const at::Tensor& temperature, const at::Tensor& lse,
                           const std::optional<at::Tensor>& ref_lse, const at::Tensor& g_logp,
                           const std::optional<at::Tensor>& g_entropy,
                           const std::optional<at::Tensor>& entropy,
                           const std::optional<at::Tensor>& g_full_kl,
                           const std::optional<at::Tensor>& full_kl) {
  int64_t N, V;  // plain variables, not a structured binding: the parallel lambdas capture them
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const bool has_ent = g_entropy.has_value();
  const bool has_kl = g_full_kl.has_value();
  Inputs in{};
  in.tgt = target.data_ptr<int64_t>();
  at::Tensor lse_f = as_f32_vec(lse, N, "lse");
  at::Tensor gl_f = as_f32_vec(g_logp, N, "g_logp");
  at::Tensor ge_f, ent_f, gk_f, kl_f, rlse_f;
  in.lse = lse_f.data_ptr<float>();
  in.gl = gl_f.data_ptr<float>();
  if (has_ent) {
    ge_f = as_f32_vec(g_entropy, N, "g_entropy");
    ent_f = as_f32_vec(entropy, N, "entropy");
    in.ge = ge_f.data_ptr<float>();
    in.ent = ent_f.data_ptr<float>();
  }
  if (has_kl) {
    TORCH_CHECK(ref3d.has_value(), "kltriton_cpp: g_full_kl needs ref_logits");
    check_rows3d(*ref3d, "ref_logits");
    TORCH_CHECK(ref3d->size(0) * ref3d->size(1) == N && ref3d->size(2) == V,
                "kltriton_cpp: ref_logits must have the shape of logits");
    gk_f = as_f32_vec(g_full_kl, N, "g_full_kl");
    kl_f = as_f32_vec(full_kl, N, "full_kl");
    rlse_f = as_f32_vec(ref_lse, N, "ref_lse");
    in.gk = gk_f.data_ptr<float>();
    in.kl = kl_f.data_ptr<float>();
    in.rlse = rlse_f.data_ptr<float>();
  }
  at::Tensor grad = gradient_buffer(N, V, logits3d.options());
  if (N == 0) return grad;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int mode = (has_ent ? kEntropy : 0) | (has_kl ? kRef | kFullKl : 0);
  // The reference is read only for the full-KL term.
  const std::optional<at::Tensor> ref_read = has_kl ? ref3d : std::nullopt;
  with_dtypes(logits3d.scalar_type(), ref_read, [&](auto tag, auto ref_tag) {
    using T = typename decltype(tag)::type;
    using R = typename decltype(ref_tag)::type;
    if (has_kl) {
      with_mode<kRef | kFullKl, kRef | kFullKl | kEntropy>(mode, [&](auto m) {
        run_backward<T, R, decltype(m)::value>(logits3d, ref3d, in, grad, temp);
      });
    } else if constexpr (std::is_same_v<T, R>) {
      with_mode<0, kEntropy>(mode, [&](auto m) { run_backward<T, T, decltype(m)::value>(logits3d, ref3d, in, grad, temp); });
    }
  });
  return grad;
}

#endif  // KLTRITON_ROW_KERNELS_ONLY

}  // namespace kltriton_cpp
