// The loss family's [N] ops on the CPU (kltriton/kernels/loss/): loss_inputs, the per-row weights a fused loss kernel
// needs before it writes the gradient (verl's agg_loss as weights, times the terms' coefficients); loss_terms, after
// the kernel, the per-token terms, the loss and its metrics from the rows' statistics, summed in row order.
#include <torch/library.h>

#include "loss_coefficients.h"

namespace kltriton_cpp {
namespace {

enum Aggregation : int { kTokenMean, kTokenSum, kSeqMeanTokenSum, kSeqMeanTokenMean, kSeqMeanTokenSumNorm };

const float* floats_of(const std::optional<at::Tensor>& t, int64_t n, const char* name, std::vector<at::Tensor>& keep) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == n, "kltriton_cpp: ", name, " has ", t->numel(), " entries, expected ", n);
  keep.push_back(t->to(at::kFloat).contiguous());
  return keep.back().data_ptr<float>();
}

double scalar_of(const std::optional<at::Tensor>& t) {
  return t->to(at::kDouble).item<double>();  // a CPU tensor: host memory, no device sync
}

}  // namespace

// [5, N] float32: each row's advantage (a per-sequence one broadcast), its aggregation weight (agg_loss(x) =
// sum_n w_n x_n over the positions with target != SKIP), and the policy, KL and entropy terms' weights (the
// aggregation weight times 1, kl_coef and -entropy_coef).
at::Tensor loss_inputs(const at::Tensor& target, int64_t num_seqs, int64_t seq_len,
                       const std::optional<at::Tensor>& cu_seqlens, int64_t aggregation,
                       const std::optional<at::Tensor>& num_tokens, const std::optional<at::Tensor>& num_seqs_agg,
                       const std::optional<at::Tensor>& horizon, const at::Tensor& advantages, bool per_seq,
                       double kl_coef, double entropy_coef) {
  const int64_t N = target.numel();
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous(), "kltriton_cpp: target must be int64");
  const int64_t* tgt = target.data_ptr<int64_t>();
  std::vector<at::Tensor> keep;
  const float* adv = floats_of(advantages, per_seq ? num_seqs : N, "advantages", keep);
  at::Tensor keep_cu;
  const int64_t* cu = nullptr;
  if (cu_seqlens.has_value()) {
    keep_cu = cu_seqlens->to(at::kLong).contiguous();
    cu = keep_cu.data_ptr<int64_t>();
  }
  // each position's sequence, and the positions with target != SKIP counted per sequence
  std::vector<int64_t> seq(N, 0);
  std::vector<double> count(std::max<int64_t>(num_seqs, 1), 0.0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t start = cu ? cu[s] : s * seq_len, end = cu ? cu[s + 1] : (s + 1) * seq_len;
    start = std::min(std::max<int64_t>(start, 0), N);
    end = std::min(std::max(end, start), N);
    for (int64_t n = start; n < end; ++n) {
      seq[n] = s;
      count[s] += tgt[n] != kSkip ? 1.0 : 0.0;
    }
  }
  double total = 0.0, nonempty = 0.0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    total += count[s];
    nonempty += count[s] > 0 ? 1.0 : 0.0;
  }
  const double sequences = num_seqs_agg.has_value() ? scalar_of(num_seqs_agg) : std::max(nonempty, 1.0);
  at::Tensor out = at::empty({5, N}, target.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const double valid = tgt[n] != kSkip ? 1.0 : 0.0;
    double w = valid;
    switch (aggregation) {
      case kTokenSum: break;
      case kTokenMean: w = valid / (num_tokens.has_value() ? scalar_of(num_tokens) : std::max(total, 1.0)); break;
      case kSeqMeanTokenSum: w = valid / sequences; break;
      case kSeqMeanTokenMean: w = valid / std::max(count[seq[n]], 1.0) / sequences; break;
      case kSeqMeanTokenSumNorm: w = valid / sequences / scalar_of(horizon); break;
      default: TORCH_CHECK(false, "kltriton_cpp: unknown aggregation ", aggregation);
    }
    const float wf = static_cast<float>(w);
    o[n] = adv[per_seq ? seq[n] : n];
    o[N + n] = wf;
    o[2 * N + n] = wf;
    o[3 * N + n] = static_cast<float>(static_cast<double>(wf) * kl_coef);
    o[4 * N + n] = static_cast<float>(static_cast<double>(wf) * -entropy_coef);
  }
  return out;
}

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
  m.impl("loss_inputs", &kltriton_cpp::loss_inputs);
  m.impl("loss_terms", &kltriton_cpp::loss_terms);
}
