// The loss family's [N] op on the CPU (kltriton/kernels/loss/): loss_terms, after the fused kernel, the per-token
// terms, the loss and its metrics from the rows' statistics, summed in row order.
#include <torch/library.h>

#include "loss_coefficients.h"
#include "loss_terms.h"

namespace kltriton_cpp {
namespace {

const float* floats_of(const std::optional<at::Tensor>& t, int64_t n, const char* name, std::vector<at::Tensor>& keep) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == n, "kltriton_cpp: ", name, " has ", t->numel(), " entries, expected ", n);
  keep.push_back(t->to(at::kFloat).contiguous());
  return keep.back().data_ptr<float>();
}

}  // namespace

// The per-token terms of a fused loss (kltriton/kernels/loss/terms.py token_terms) from the rows' statistics and
// inputs, the loss sum(w_pg pg + w_kl kl + w_ent entropy) and the metrics (constants.py LOSS_METRICS), summed in row
// order in double. Returns [loss (0-dim), kl [N], ratio [N], metrics]: kl and ratio 0 where target == SKIP.
std::vector<at::Tensor> loss_terms(const at::Tensor& logp, const std::optional<at::Tensor>& ref_logp, bool ref_given,
                                   const std::optional<at::Tensor>& full_kl, const std::optional<at::Tensor>& entropy,
                                   const at::Tensor& target, const std::optional<at::Tensor>& old_logp,
                                   const at::Tensor& advantages, const at::Tensor& w_pg, const at::Tensor& w_kl,
                                   const at::Tensor& w_ent, const at::Tensor& w_agg,
                                   const at::Tensor& hyperparameters, const std::string& loss_type,
                                   const std::string& estimator, bool straight_through) {
  const int64_t N = target.numel();
  TORCH_CHECK(hyperparameters.scalar_type() == at::kDouble && hyperparameters.numel() == KLTRITON_NUM_HP,
              "kltriton_cpp: hyperparameters must be the float64 vector of constants.py");
  const at::Tensor hp = hyperparameters.contiguous();
  const LossParams P(loss_type, estimator, straight_through, hp.data_ptr<double>());
  std::vector<at::Tensor> keep;
  const float* lp = floats_of(logp, N, "logp", keep);
  const float* ref = floats_of(ref_logp, N, "ref_logp", keep);
  const float* fkl = floats_of(full_kl, N, "full_kl", keep);
  const float* ent = floats_of(entropy, N, "entropy", keep);
  const float* old = floats_of(old_logp, N, "old_logp", keep);
  const float* adv = floats_of(advantages, N, "advantages", keep);
  const float* wpg = floats_of(w_pg, N, "w_pg", keep);
  const float* wkl = floats_of(w_kl, N, "w_kl", keep);
  const float* went = floats_of(w_ent, N, "w_ent", keep);
  const float* wagg = floats_of(w_agg, N, "w_agg", keep);
  TORCH_CHECK(P.estimator == kNoKl || (P.estimator == kFull ? full_kl.has_value() : ref_logp.has_value()),
              "kltriton_cpp: the KL term needs the reference's log-probs or the full KL");
  const int64_t* tgt = target.data_ptr<int64_t>();
  const auto f32 = target.options().dtype(at::kFloat);
  at::Tensor kl_out = at::empty({N}, f32), ratio_out = at::empty({N}, f32);
  float* klo = kl_out.data_ptr<float>();
  float* ro = ratio_out.data_ptr<float>();
  double loss = 0.0, pg_loss = 0.0, kl_loss = 0.0, entropy_loss = 0.0, count = 0.0, clipped = 0.0, lower = 0.0;
  double ppo_kl = 0.0, kl_sum = 0.0, entropy_sum = 0.0;
  double high = -std::numeric_limits<double>::infinity(), low = std::numeric_limits<double>::infinity();
  bool nan_ratio = false;
  for (int64_t n = 0; n < N; ++n) {
    if (tgt[n] == kSkip) {
      klo[n] = ro[n] = 0.f;
      continue;
    }
    const double l = lp[n], o = old ? static_cast<double>(old[n]) : l, A = adv[n];
    const PgTerms t = pg_terms(P, l, o, static_cast<double>(static_cast<float>(l - o)), A);
    double kl = 0.0;
    if (P.estimator == kFull) {
      kl = std::min(std::max(static_cast<double>(fkl[n]), -P.kl_clamp), P.kl_clamp);
    } else if (P.estimator != kNoKl) {
      kl = kl_estimate(P.estimator, P.straight_through, l - (ref_given && tgt[n] < 0 ? 0.0 : ref[n]), P.kl_clamp).value;
    }
    if (P.kl_ratio) kl *= t.ratio;  // TRL's bias-corrected KL
    const double H = ent ? ent[n] : 0.0;
    klo[n] = static_cast<float>(kl);
    ro[n] = static_cast<float>(t.ratio);
    loss += wpg[n] * t.pg + wkl[n] * kl + went[n] * H;
    pg_loss += wpg[n] * t.pg;
    kl_loss += wagg[n] * kl;
    entropy_loss += wagg[n] * H;
    count += 1.0;
    clipped += t.clipped ? 1.0 : 0.0;
    lower += t.clipped_lower ? 1.0 : 0.0;
    ppo_kl -= t.log_ratio;
    kl_sum += kl;
    entropy_sum += H;
    nan_ratio |= std::isnan(t.ratio);
    high = std::max(high, t.ratio);
    low = std::min(low, t.ratio);
  }
  const double denominator = std::max(count, 1.0), nan = std::numeric_limits<double>::quiet_NaN();
  at::Tensor metrics = at::empty({KLTRITON_NUM_METRICS}, f32);
  float* m = metrics.data_ptr<float>();
  m[KLTRITON_METRIC_PG_LOSS] = static_cast<float>(pg_loss);
  m[KLTRITON_METRIC_KL_LOSS] = static_cast<float>(kl_loss);
  m[KLTRITON_METRIC_ENTROPY_LOSS] = static_cast<float>(entropy_loss);
  m[KLTRITON_METRIC_CLIPFRAC] = static_cast<float>(clipped / denominator);
  m[KLTRITON_METRIC_CLIPFRAC_LOWER] = static_cast<float>(lower / denominator);
  m[KLTRITON_METRIC_PPO_KL] = static_cast<float>(ppo_kl / denominator);
  m[KLTRITON_METRIC_KL_MEAN] = static_cast<float>(kl_sum / denominator);
  m[KLTRITON_METRIC_ENTROPY_MEAN] = static_cast<float>(entropy_sum / denominator);
  m[KLTRITON_METRIC_RATIO_MAX] = static_cast<float>(count == 0 ? 0.0 : (nan_ratio ? nan : high));
  m[KLTRITON_METRIC_RATIO_MIN] = static_cast<float>(count == 0 ? 0.0 : (nan_ratio ? nan : low));
  return {at::full({}, loss, f32), kl_out, ratio_out, metrics};
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("loss_terms", &kltriton_cpp::loss_terms);
}
