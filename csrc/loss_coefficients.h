// The policy loss's derivative per row (family `loss`, kltriton/kernels/loss/): the fused loss kernel
// (loss_forward.cpp) computes, from a row's statistics and its per-row weights,
//   d loss_n / d (logp, entropy, full_kl) of  w_pg * pg(logp) + w_kl * kl(logp) [* ratio] + w_ent * entropy
// and turns it into the row's gradient basis (row_backward.h). The same derivative is written in
// Triton (kltriton/kernels/loss/triton.py) and in PyTorch (kltriton/kernels/loss/terms.py, the formulas
// themselves); tests/kernels/test_loss_coefficients.py holds the three against each other. At an
// exact tie of max / min the unclipped branch takes the whole gradient.
#pragma once

#include "row_backward.h"
#include "row_forward.h"

namespace kltriton_cpp {

// The formulas with a fused kernel, named as in kltriton/kernels/loss/terms.py (FUSED), and the KL estimators.
enum LossType : int { kKlOnly, kPpo, kCispo, kSapo, kGpg, kDppoTv, kDppoKl, kDro, kClippedRatio };
enum KlEstimator : int { kNoKl, kK1, kAbs, kK2, kK3, kFull };

inline LossType loss_type_of(const std::string& name) {
  static const char* const names[] = {"kl_only", "ppo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro",
                                      "clipped_ratio"};
  for (int i = 0; i <= kClippedRatio; ++i) {
    if (name == names[i]) return static_cast<LossType>(i);
  }
  TORCH_CHECK(false, "kltriton_cpp: no fused kernel for loss_type '", name, "'");
  return kPpo;
}

inline KlEstimator estimator_of(const std::string& name) {
  static const char* const names[] = {"", "k1", "abs", "k2", "k3", "full"};
  for (int i = 0; i <= kFull; ++i) {
    if (name == names[i]) return static_cast<KlEstimator>(i);
  }
  TORCH_CHECK(false, "kltriton_cpp: unknown KL estimator '", name, "'");
  return kNoKl;
}

// A per-token KL estimator's value on dk = logp - ref_logp, clamped to [-kl_clamp, kl_clamp], and its derivative
// w.r.t. logp (0 where the clamp holds the value; the straight-through names, verl's "k3+": the value of the
// estimator, the derivative of k2, dk). Not for kFull (the full KL is a statistic).
struct KlEstimate {
  double value, slope;
};

inline KlEstimate kl_estimate(KlEstimator estimator, bool straight_through, double dk, double kl_clamp) {
  KlEstimate k{0.0, 0.0};
  switch (estimator) {
    case kK1: k = {dk, 1.0}; break;
    case kAbs: k = {std::abs(dk), dk > 0 ? 1.0 : (dk < 0 ? -1.0 : 0.0)}; break;
    case kK2: k = {0.5 * dk * dk, dk}; break;
    case kK3: k = {std::expm1(-dk) + dk, -std::expm1(-dk)}; break;
    default: TORCH_CHECK(false, "kltriton_cpp: no per-token value for KL estimator ", static_cast<int>(estimator));
  }
  if (std::abs(k.value) > kl_clamp) k = {k.value > 0 ? kl_clamp : -kl_clamp, 0.0};
  if (straight_through) k.slope = dk;
  return k;
}

// The call's loss type, estimator and hyperparameters (the float64 vector, slots of constants.py).
struct LossParams {
  LossType loss_type;
  KlEstimator estimator;
  bool straight_through;
  double ratio_low, ratio_high, dual_clip, kl_clamp;  // dual_clip / kl_clamp: +inf when off
  double log_ratio_clamp;  // the ratio is exp(clamp(d, -c, c)); +inf: no clamp
  double delta, tau_pos, tau_neg, clip_ratio_c, dro_beta;  // delta: +inf when off
  bool kl_ratio;  // the KL term is multiplied by the ratio (TRL use_bias_correction_kl)

  LossParams(const std::string& type, const std::string& est, bool straight, const double* hp)
      : loss_type(loss_type_of(type)),
        estimator(estimator_of(est)),
        straight_through(straight),
        ratio_low(hp[KLTRITON_HP_RATIO_LOW]),
        ratio_high(hp[KLTRITON_HP_RATIO_HIGH]),
        dual_clip(hp[KLTRITON_HP_DUAL_CLIP]),
        kl_clamp(hp[KLTRITON_HP_KL_CLAMP]),
        log_ratio_clamp(hp[KLTRITON_HP_LOG_RATIO_CLAMP]),
        delta(hp[KLTRITON_HP_DELTA]),
        tau_pos(hp[KLTRITON_HP_TAU_POS]),
        tau_neg(hp[KLTRITON_HP_TAU_NEG]),
        clip_ratio_c(hp[KLTRITON_HP_CLIP_RATIO_C]),
        dro_beta(hp[KLTRITON_HP_DRO_BETA]),
        kl_ratio(hp[KLTRITON_HP_KL_RATIO] != 0.0) {}
};

// Per-row inputs of the loss (kltriton.kernels.loss.LossInputs).
struct RowIn {
  const float *old, *adv, *wpg, *wkl, *went, *rlogp;  // old / rlogp: nullptr when absent
};

// DPPO's trust region (verl dppo_tv / dppo_kl): the divergence between p = exp(lp) and p_old = exp(old)
// within clip_high (A > 0) or clip_low (A <= 0).
inline bool dppo_valid(const LossParams& P, double lp, double old, double A) {
  const double clip_low = 1.0 - P.ratio_low, clip_high = P.ratio_high - 1.0;
  const double p = std::exp(lp), p_old = std::exp(old);
  if (P.loss_type == kDppoTv) return A > 0 ? (p - p_old) <= clip_high : (p - p_old) >= -clip_low;
  const double div = p_old * (old - lp) + (1.0 - p_old) * std::log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8));
  return A > 0 ? (div <= clip_high || p <= p_old) : (div <= clip_low || p >= p_old);
}

// The importance ratio exp(clamp(d, -c, c)) and its derivative w.r.t. logp (0 beyond the clamp).
struct Ratio {
  double value, slope;
  Ratio(const LossParams& P, double d)
      : value(std::exp(std::min(std::max(d, -P.log_ratio_clamp), P.log_ratio_clamp))),
        slope(std::abs(d) <= P.log_ratio_clamp ? value : 0.0) {}
  // g * d ratio / d logp; a zero g stays 0 where an unclamped ratio overflows to +inf.
  double chain(double g) const { return g == 0.0 ? 0.0 : g * slope; }
};

// d pg / d logp of one row (before the row's weight w_pg), for d = fp32(lp - old).
inline double pg_slope(const LossParams& P, double lp, double old, double d, double A) {
  const Ratio r(P, d);
  const double ratio = r.value;
  switch (P.loss_type) {
    case kKlOnly:  // no policy-gradient term
      return 0.0;
    case kPpo: {  // max(-A min(r, delta), -A clip(r)), held by the dual clip for A < 0
      const double pg1 = -A * std::min(ratio, P.delta), pg2 = -A * std::min(std::max(ratio, P.ratio_low), P.ratio_high);
      double g_ratio = pg1 >= pg2 ? (ratio <= P.delta ? -A : 0.0)
                                  : (ratio >= P.ratio_low && ratio <= P.ratio_high ? -A : 0.0);
      if (A < 0 && std::max(pg1, pg2) > -A * P.dual_clip) g_ratio = 0.0;  // dual clip holds the loss
      return r.chain(g_ratio);
    }
    case kCispo:  // -sg(clip(ratio)) * A * logp
      return -std::min(std::max(ratio, P.ratio_low), P.ratio_high) * A;
    case kSapo: {  // -A * 4 sigmoid(tau (r - 1)) / tau
      const double tau = A > 0 ? P.tau_pos : P.tau_neg;
      const double s = 1.0 / (1.0 + std::exp(-tau * (ratio - 1.0)));
      return r.chain(-A * 4.0 * s * (1.0 - s));
    }
    case kGpg:  // -logp * A
      return -A;
    case kClippedRatio:  // -clip(r) * A, through the ratio inside the range
      return ratio >= P.ratio_low && ratio <= P.ratio_high ? r.chain(-A) : 0.0;
    case kDppoTv:
    case kDppoKl:  // -A * sg(min(r, clip_ratio_c)) * logp inside the trust region
      return dppo_valid(P, lp, old, A) ? -A * std::min(ratio, P.clip_ratio_c) : 0.0;
    case kDro:  // -(logp A - beta / 2 (logp - old)^2)
      return -A + P.dro_beta * d;
  }
  TORCH_CHECK(false, "kltriton_cpp: pg_slope has no derivative for loss type ", static_cast<int>(P.loss_type));
  return 0.0;
}

// The policy-gradient term of one row and verl's flags (kltriton/kernels/loss/terms.py FORMULAS, the fused ones): the
// per-token loss before its weight, the ratio reported, pg_clipfrac's and pg_clipfrac_lower's flags, and the
// log-ratio whose negative ppo_kl averages. d = fp32(lp - old).
struct PgTerms {
  double pg, ratio;
  bool clipped, clipped_lower;
  double log_ratio;
};

inline PgTerms pg_terms(const LossParams& P, double lp, double old, double d, double A) {
  const double log_ratio = std::min(std::max(d, -P.log_ratio_clamp), P.log_ratio_clamp);
  const double ratio = std::exp(log_ratio);
  const double clip = std::min(std::max(ratio, P.ratio_low), P.ratio_high);
  switch (P.loss_type) {
    case kKlOnly:  // no policy-gradient term
      return {0.0, ratio, false, false, log_ratio};
    case kPpo: {  // max(-A min(r, delta), -A clip(r)), at most -A dual_clip for A < 0
      const double pg1 = -A * std::min(ratio, P.delta), pg2 = -A * clip, clip1 = std::max(pg1, pg2);
      const double pg3 = -A * P.dual_clip;
      return {A < 0 ? std::min(clip1, pg3) : clip1, ratio, pg2 > pg1, clip1 > pg3 && A < 0, log_ratio};
    }
    case kCispo:  // -sg(clip(r)) A logp
      return {-clip * A * lp, ratio, ratio != clip, false, log_ratio};
    case kClippedRatio:  // -clip(r) A
      return {-clip * A, ratio, ratio != clip, false, log_ratio};
    case kSapo: {  // -A sigmoid(tau (r - 1)) 4 / tau
      const double tau = A > 0 ? P.tau_pos : P.tau_neg;
      return {-(4.0 / tau) / (1.0 + std::exp(-tau * (ratio - 1.0))) * A, ratio, false, false, log_ratio};
    }
    case kGpg:  // -logp A
      return {-lp * A, ratio, false, false, log_ratio};
    case kDppoTv:
    case kDppoKl: {  // -A sg(min(r, clip_ratio_c)) logp inside the trust region
      const bool valid = dppo_valid(P, lp, old, A);
      return {valid ? -A * std::min(ratio, P.clip_ratio_c) * lp : 0.0, ratio, !valid, ratio > P.clip_ratio_c && valid,
              log_ratio};
    }
    case kDro:  // -(logp A - beta / 2 (logp - old)^2); its log-ratio is not clamped
      return {-(lp * A - 0.5 * P.dro_beta * d * d), ratio, false, false, d};
  }
  TORCH_CHECK(false, "kltriton_cpp: pg_terms has no formula for loss type ", static_cast<int>(P.loss_type));
  return {};
}

// d loss_n / d (logp, full_kl) of one row: the policy-gradient term and the KL term (times the ratio with
// kl_ratio: slope kl' r + kl dr). full_kl: the row's full KL (the "full" estimator).
struct RowSlopes {
  double logp, full_kl;
};

inline RowSlopes row_g_logp(const LossParams& P, const RowIn& in, int64_t n, double lp, double rlp,
                            double full_kl = 0.0) {
  const double old = in.old ? static_cast<double>(in.old[n]) : lp;  // on-policy: old = logp
  const double d = static_cast<double>(static_cast<float>(lp - old));
  RowSlopes g{in.wpg[n] * pg_slope(P, lp, old, d, in.adv[n]), 0.0};
  if (P.estimator == kNoKl) return g;
  const Ratio r(P, d);
  const double ratio = r.value, d_ratio = r.slope;
  const double weight = P.kl_ratio ? ratio : 1.0;
  if (P.estimator == kFull) {  // the full KL's own gradient goes through its statistic; 0 where clamped
    const bool held = std::abs(full_kl) > P.kl_clamp;
    g.full_kl = held ? 0.0 : in.wkl[n] * weight;
    const double value = held ? (full_kl > 0 ? P.kl_clamp : -P.kl_clamp) : full_kl;
    if (P.kl_ratio) g.logp += in.wkl[n] * value * d_ratio;
    return g;
  }
  const KlEstimate k = kl_estimate(P.estimator, P.straight_through, lp - rlp, P.kl_clamp);
  g.logp += in.wkl[n] * (k.slope * weight + (P.kl_ratio ? k.value * d_ratio : 0.0));
  return g;
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
