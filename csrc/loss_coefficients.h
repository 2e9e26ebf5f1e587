// The policy loss's derivative per row (family `loss`, kltriton/kernels/loss/): the fused loss kernel
// (loss_forward.cpp) computes, from a row's statistics and its per-row weights,
//   d loss_n / d (logp, entropy, full_kl) of  w_pg * pg(logp) + w_kl * kl(logp) + w_ent * entropy
// and turns it into the row's gradient basis (row_backward.h). The same derivative is written in
// Triton (kltriton/kernels/loss/triton.py) and in PyTorch (kltriton/kernels/loss/terms.py, the formulas
// themselves); tests/kernels/test_loss_coefficients.py holds the three against each other. At an
// exact tie of max / min the unclipped branch takes the whole gradient.
#pragma once

#include "row_backward.h"
#include "row_forward.h"

namespace kltriton_cpp {

// The loss types and KL estimators with a fused kernel, named as in kltriton/kernels/loss/terms.py.
enum LossType : int { kPpo, kCispo };
enum KlEstimator : int { kNoKl, kK1, kAbs, kK2, kK3, kFull };

inline LossType loss_type_of(const std::string& name) {
  if (name == "ppo") return kPpo;
  TORCH_CHECK(name == "cispo", "kltriton_cpp: no fused kernel for loss_type '", name, "'");
  return kCispo;
}

inline KlEstimator estimator_of(const std::string& name) {
  static const char* const names[] = {"", "k1", "abs", "k2", "k3", "full"};
  for (int i = 0; i <= kFull; ++i) {
    if (name == names[i]) return static_cast<KlEstimator>(i);
  }
  TORCH_CHECK(false, "kltriton_cpp: unknown KL estimator '", name, "'");
  return kNoKl;
}

constexpr double kLogRatioClamp = KLTRITON_LOG_RATIO_CLAMP;

// The call's loss type, estimator and hyperparameters (the float64 vector, slots of constants.py).
struct LossParams {
  LossType loss_type;
  KlEstimator estimator;
  bool straight_through;
  double ratio_low, ratio_high, dual_clip, kl_clamp;  // dual_clip / kl_clamp: +inf when off

  LossParams(const std::string& type, const std::string& est, bool straight, const double* hp)
      : loss_type(loss_type_of(type)),
        estimator(estimator_of(est)),
        straight_through(straight),
        ratio_low(hp[KLTRITON_HP_RATIO_LOW]),
        ratio_high(hp[KLTRITON_HP_RATIO_HIGH]),
        dual_clip(hp[KLTRITON_HP_DUAL_CLIP]),
        kl_clamp(hp[KLTRITON_HP_KL_CLAMP]) {}
};

// Per-row inputs of the loss (kltriton.kernels.loss.LossInputs).
struct RowIn {
  const float *old, *adv, *wpg, *wkl, *went, *rlogp;  // old / rlogp: nullptr when absent
};

// d loss_n / d logp of one row (the policy-gradient term and the KL term's slope).
inline double row_g_logp(const LossParams& P, const RowIn& in, int64_t n, double lp, double rlp) {
  const double old = in.old ? static_cast<double>(in.old[n]) : lp;  // on-policy: old = logp
  const double A = in.adv[n];
  const double d = static_cast<double>(static_cast<float>(lp - old));
  const double ratio = std::exp(std::min(std::max(d, -kLogRatioClamp), kLogRatioClamp));
  const double clipped = std::min(std::max(ratio, P.ratio_low), P.ratio_high);
  double g_lp = 0.0;
  if (P.loss_type == kPpo) {
    const double pg1 = -A * ratio, pg2 = -A * clipped;
    double g_ratio = pg1 >= pg2 ? -A : 0.0;
    if (A < 0 && std::max(pg1, pg2) > -A * P.dual_clip) g_ratio = 0.0;  // dual clip holds the loss
    const double d_ratio = std::abs(d) <= kLogRatioClamp ? ratio : 0.0;
    g_lp = in.wpg[n] * g_ratio * d_ratio;
  } else {  // cispo: -sg(clip(ratio)) * A * logp
    g_lp = -in.wpg[n] * clipped * A;
  }
  if (P.estimator != kNoKl && P.estimator != kFull) {
    const double dk = lp - rlp;
    double value = 0.0, slope = 0.0;
    switch (P.estimator) {
      case kK1: value = dk; slope = 1.0; break;
      case kAbs: value = std::abs(dk); slope = dk > 0 ? 1.0 : (dk < 0 ? -1.0 : 0.0); break;
      case kK2: value = 0.5 * dk * dk; slope = dk; break;
      default: value = std::expm1(-dk) + dk; slope = -std::expm1(-dk); break;  // k3
    }
    if (std::abs(value) > P.kl_clamp) slope = 0.0;
    if (P.straight_through) slope = dk;  // verl "k3+": the value of k3, the gradient of k2
    g_lp += in.wkl[n] * slope;
  }
  return g_lp;
}

// The gradient basis of a loss row from d loss / d (logp, entropy, full_kl) and the row's statistics,
// in double (kltriton/kernels/statistics.py gradient_basis).
inline RowCoef loss_row_coef(const Temperatures& temp, int64_t n, const RowOut& r, double gl, double ge, double gk) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  const double inv = static_cast<double>(hi) + lo;
  const double H = r.v[kStatEntropy], K = r.v[kStatFullKl];
  const double c_p = gl + (ge != 0.0 ? ge * H : 0.0) + (gk != 0.0 ? gk * K : 0.0);
  return RowCoef{hi, static_cast<float>(lo), r.v[kStatLse], r.v[kStatRefLse], static_cast<float>(inv * gl),
                 static_cast<float>(inv * c_p), static_cast<float>(inv * (ge - gk)), static_cast<float>(inv * gk)};
}

}  // namespace kltriton_cpp
