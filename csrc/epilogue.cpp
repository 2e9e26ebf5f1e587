// The epilogue family's ops on the CPU (kltriton/kernels/epilogue/): the [N] arithmetic after the statistics, in one
// op instead of a string of [N] tensor ops. kl_reward: the per-token KL estimator, and with a coefficient the reward
// (rewards - coef * kl, the clipped score at each sequence's last scored position) and each sequence's mean KL;
// kl_reward_backward: its gradient w.r.t. the log-prob and the full KL.
#include <torch/library.h>

#include "loss_coefficients.h"

namespace kltriton_cpp {
namespace {

// Sequence s's positions [start, end): a segment of cu_seqlens, or the s-th run of seq_len positions, within [0, N)
// whatever the offsets say (malformed ones are flagged by the layout op; nothing is read out of bounds).
struct Sequences {
  int64_t N, count, seq_len;
  const int64_t* cu;  // nullptr: runs of seq_len
  std::pair<int64_t, int64_t> bounds(int64_t s) const {
    int64_t start = cu ? cu[s] : s * seq_len, end = cu ? cu[s + 1] : (s + 1) * seq_len;
    start = std::min(std::max<int64_t>(start, 0), N);
    return {start, std::min(std::max(end, start), N)};
  }
};

const float* floats(const std::optional<at::Tensor>& t, int64_t n, const char* name, std::vector<at::Tensor>& keep) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == n, "kltriton_cpp: ", name, " has ", t->numel(), " entries, expected ", n);
  keep.push_back(t->to(at::kFloat).contiguous());
  return keep.back().data_ptr<float>();
}

// The KL estimator of a row (full: the full KL clamped) and its derivatives w.r.t. logp and the full KL.
struct RowKl {
  double value, d_logp, d_full_kl;
};

struct KlInputs {
  const float *logp, *full_kl, *ref;
  const int64_t* target;
  bool ref_given;
  KlEstimator estimator;
  bool straight;
  double kl_clamp;

  RowKl at(int64_t n) const {
    if (estimator == kFull) {
      const double f = full_kl[n];
      const bool held = std::abs(f) > kl_clamp;
      return {held ? (f > 0 ? kl_clamp : -kl_clamp) : f, 0.0, held ? 0.0 : 1.0};
    }
    const double r = ref_given && target[n] < 0 ? 0.0 : static_cast<double>(ref[n]);  // given: 0 where not scored
    const KlEstimate k = kl_estimate(estimator, straight, static_cast<double>(logp[n]) - r, kl_clamp);
    return {k.value, k.slope, 0.0};
  }
};

KlInputs kl_inputs(const at::Tensor& logp, const std::optional<at::Tensor>& full_kl, const at::Tensor& ref_logp,
                   bool ref_given, const at::Tensor& target, const std::string& estimator, bool straight,
                   double kl_clamp, std::vector<at::Tensor>& keep) {
  const int64_t N = target.numel();
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous(), "kltriton_cpp: target must be int64");
  KlInputs in{floats(logp, N, "logp", keep), floats(full_kl, N, "full_kl", keep), floats(ref_logp, N, "ref_logp", keep),
              target.data_ptr<int64_t>(), ref_given, estimator_of(estimator), straight, kl_clamp};
  TORCH_CHECK(in.estimator != kNoKl && (in.estimator != kFull || full_kl.has_value()),
              "kltriton_cpp: the full KL estimator needs the full KL");
  return in;
}

Sequences sequences_of(int64_t N, int64_t num_seqs, int64_t seq_len, const std::optional<at::Tensor>& cu_seqlens,
                       at::Tensor& keep) {
  const int64_t* cu = nullptr;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(cu_seqlens->numel() == num_seqs + 1, "kltriton_cpp: cu_seqlens must have num_seqs + 1 entries");
    keep = cu_seqlens->to(at::kLong).contiguous();
    cu = keep.data_ptr<int64_t>();
  }
  return Sequences{N, num_seqs, seq_len, cu};
}

}  // namespace

std::vector<at::Tensor> kl_reward(const at::Tensor& logp, const std::optional<at::Tensor>& full_kl,
                                  const at::Tensor& ref_logp, bool ref_given, const at::Tensor& target,
                                  int64_t num_seqs, int64_t seq_len, const std::optional<at::Tensor>& cu_seqlens,
                                  const std::string& estimator, bool straight_through, double kl_clamp,
                                  const std::optional<at::Tensor>& coef, const std::optional<at::Tensor>& rewards,
                                  const std::optional<at::Tensor>& scores, double score_clip) {
  const int64_t N = target.numel();
  std::vector<at::Tensor> keep;
  const KlInputs in = kl_inputs(logp, full_kl, ref_logp, ref_given, target, estimator, straight_through, kl_clamp,
                                keep);
  const auto f32 = target.options().dtype(at::kFloat);
  const bool shaped = coef.has_value();
  at::Tensor kl = at::empty({N}, f32), ref_out = at::empty({ref_given ? N : 0}, f32);
  at::Tensor reward = at::empty({shaped ? N : 0}, f32), per_seq = at::zeros({shaped ? num_seqs : 0}, f32);
  at::Tensor count = at::zeros({shaped ? num_seqs : 0}, f32);
  float* k = kl.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    k[n] = static_cast<float>(in.at(n).value);
    if (ref_given) ref_out.data_ptr<float>()[n] = in.target[n] >= 0 ? in.ref[n] : 0.f;
  }
  if (!shaped) return {kl, ref_out, reward, per_seq, count};
  TORCH_CHECK(coef->numel() == 1 && coef->device().is_cpu(), "kltriton_cpp: coef must be a CPU scalar");
  const double c = coef->to(at::kDouble).item<double>();  // host memory: no device sync
  const float* given = floats(rewards, N, "rewards", keep);
  const float* score = floats(scores, num_seqs, "scores", keep);
  at::Tensor keep_cu;
  const Sequences seqs = sequences_of(N, num_seqs, seq_len, cu_seqlens, keep_cu);
  float* r = reward.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) r[n] = static_cast<float>((given ? given[n] : 0.0) - c * k[n]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const auto [start, end] = seqs.bounds(s);
    double total = 0.0;
    int64_t scored = 0, last = -1;
    for (int64_t n = start; n < end; ++n) {
      if (in.target[n] == kSkip) continue;  // an OUT_OF_RANGE position counts: its NaN shows in the mean
      total += k[n];
      ++scored;
      last = n;
    }
    per_seq.data_ptr<float>()[s] = static_cast<float>(total / std::max<int64_t>(scored, 1));
    count.data_ptr<float>()[s] = static_cast<float>(scored);
    if (score != nullptr && last >= 0) {
      const double bonus = std::min(std::max(static_cast<double>(score[s]), -score_clip), score_clip);
      r[last] = static_cast<float>(r[last] + bonus);
    }
  }
  return {kl, ref_out, reward, per_seq, count};
}

std::vector<at::Tensor> kl_reward_backward(const at::Tensor& logp, const std::optional<at::Tensor>& full_kl,
                                           const at::Tensor& ref_logp, bool ref_given, const at::Tensor& target,
                                           int64_t num_seqs, int64_t seq_len,
                                           const std::optional<at::Tensor>& cu_seqlens, const std::string& estimator,
                                           bool straight_through, double kl_clamp,
                                           const std::optional<at::Tensor>& coef,
                                           const std::optional<at::Tensor>& count,
                                           const std::optional<at::Tensor>& g_kl,
                                           const std::optional<at::Tensor>& g_reward,
                                           const std::optional<at::Tensor>& g_kl_per_seq) {
  const int64_t N = target.numel();
  std::vector<at::Tensor> keep;
  const KlInputs in = kl_inputs(logp, full_kl, ref_logp, ref_given, target, estimator, straight_through, kl_clamp,
                                keep);
  const float* gk = floats(g_kl, N, "g_kl", keep);
  const float* gr = floats(g_reward, N, "g_reward", keep);
  const float* gs = floats(g_kl_per_seq, num_seqs, "g_kl_per_seq", keep);
  const float* counts = floats(count, num_seqs, "count", keep);
  TORCH_CHECK((gr == nullptr || coef.has_value()) && (gs == nullptr || counts != nullptr),
              "kltriton_cpp: the reward's gradient needs coef and the sequences' counts");
  const double c = gr != nullptr ? coef->to(at::kDouble).item<double>() : 0.0;
  // d loss / d kl per position: the KL's own gradient, the reward's (-coef), the sequence mean's (1 / count)
  std::vector<double> g(N, 0.0);
  for (int64_t n = 0; n < N; ++n) g[n] = (gk ? gk[n] : 0.0) - (gr ? c * gr[n] : 0.0);
  if (gs != nullptr) {
    at::Tensor keep_cu;
    const Sequences seqs = sequences_of(N, num_seqs, seq_len, cu_seqlens, keep_cu);
    for (int64_t s = 0; s < num_seqs; ++s) {
      const auto [start, end] = seqs.bounds(s);
      const double share = gs[s] / std::max(static_cast<double>(counts[s]), 1.0);
      for (int64_t n = start; n < end; ++n) g[n] += in.target[n] == kSkip ? 0.0 : share;
    }
  }
  const auto f32 = target.options().dtype(at::kFloat);
  const bool full = in.estimator == kFull;
  at::Tensor g_logp = at::empty({full ? 0 : N}, f32), g_full = at::empty({full ? N : 0}, f32);
  float* out = full ? g_full.data_ptr<float>() : g_logp.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const RowKl k = in.at(n);
    const double slope = full ? k.d_full_kl : k.d_logp;
    out[n] = static_cast<float>(g[n] == 0.0 ? 0.0 : g[n] * slope);
  }
  return {g_logp, g_full};
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("kl_reward", &kltriton_cpp::kl_reward);
  m.impl("kl_reward_backward", &kltriton_cpp::kl_reward_backward);
}
