// The loss family's fused op on the CPU: per row of [A, B, V] logits, while the row stays in L1/L2,
// the streaming statistics (row_forward.h), the row's loss derivative and gradient basis
// (loss_coefficients.h), then the gradient pass (row_backward.h) on the same row: the logits are read
// from memory once and the gradient written once.
#include <torch/library.h>

#include "layout.h"
#include "loss_coefficients.h"
#include "loss_terms.h"

namespace kltriton_cpp {
namespace {

// Rows up to this many entries keep their forward's exponentials for the gradient pass (ExpCache): the kept
// row (4 bytes an entry) stays in L2 next to the logits row and its gradient. Longer rows recompute them.
constexpr int64_t kCacheVocab = int64_t{1} << 16;

template <typename T, int FMODE, int BMODE>
void run_loss(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d, const int64_t* tgt, int64_t N,
              int64_t V, const Temperatures& temp, const LossParams& P, const RowIn& in, bool entropy_grad,
              float* const* out, T* grad) {
  constexpr bool REF = FMODE & kRef;
  const Rows3d X(logits3d);
  const Rows3d Y = REF ? Rows3d(*ref3d) : Rows3d();
  const bool keep_exps = grad != nullptr && V <= kCacheVocab;
  const int64_t padded = (V + kW - 1) / kW * kW, block_len = kBlockVecs * kW;
  const int64_t blocks = (V / kW + kBlockVecs - 1) / kBlockVecs + (V % kW ? 1 : 0);
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    std::vector<float> kept(keep_exps ? padded + 2 * blocks * kW : 0);
    const ExpCache cache{kept.data(), kept.data() + padded};
    float* scale = kept.data() + padded + blocks * kW;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t tg = tgt[n];
      T* g = grad ? grad + n * V : nullptr;
      RowOut r;
      float hi;
      double lo;
      temp.inverse(n, hi, lo);
      if (tg < 0 || tg >= V) {
        r = skipped_row(tg);
      } else {
        r = forward_row<T, T, FMODE>(X.row<T>(n), REF ? Y.row<T>(n) : nullptr, V, tg, hi, lo, -kInf,
                                     keep_exps ? &cache : nullptr);
      }
      for (int i = 0; i < kNumStats; ++i) {
        if (out[i] != nullptr) out[i][n] = r.v[i];
      }
      if (g == nullptr) continue;
      if (tg < 0 || tg >= V || !std::isfinite(r.v[kStatLse])) {
        zero_row(g, V);
        continue;
      }
      const double lp = r.v[kStatLogp];
      const double rlp = REF ? r.v[kStatRefLogp] : (in.rlogp ? in.rlogp[n] : 0.f);
      const double fkl = P.estimator == kFull ? r.v[kStatFullKl] : 0.0;
      const RowSlopes s = row_g_logp(P, in, n, lp, rlp, fkl);
      const double gl = static_cast<float>(s.logp);
      const double ge = entropy_grad ? in.went[n] : 0.0;
      const double gk = static_cast<float>(s.full_kl);
      if (gl == 0.0 && ge == 0.0 && gk == 0.0) {  // nothing to write but zeros (the entropy mask's first pass)
        zero_row(g, V);
        continue;
      }
      const RowCoef k = loss_row_coef(temp, n, r, gl, ge, gk);
      const T* y = (BMODE & kPLogq) ? Y.row<T>(n) : nullptr;
      if (!keep_exps) {
        backward_row<T, T, BMODE>(X.row<T>(n), y, g, V, tg, k);
        continue;
      }
      // p = e * exp(frame / T - lse): one exponential per block instead of one per entry (every lane of a block
      // holds the same frame, row_forward.h)
      const double inv_t = static_cast<double>(hi) + lo, lse = r.v[kStatLse];
      for (int64_t b = 0; b < blocks; ++b) {
        const float f = static_cast<float>(std::min(std::exp(cache.frames[b * kW] * inv_t - lse), double{kMaxFloat}));
        std::fill(scale + b * kW, scale + (b + 1) * kW, f);
      }
      backward_row_cached<T, T, BMODE>(X.row<T>(n), y, g, V, tg, k, cache.e, scale, block_len);
    }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (keep_exps) _mm_sfence();  // the rows' streaming stores are visible before the parallel region ends
#endif
  });
}

const float* f32_ptr(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N,
              "kltriton_cpp: ", name, " must be a contiguous float32 tensor with one entry per row");
  return t->data_ptr<float>();
}

const double* hyperparameters_ptr(const at::Tensor& hp) {
  TORCH_CHECK(hp.scalar_type() == at::kDouble && hp.is_contiguous() && hp.numel() == KLTRITON_NUM_HP,
              "kltriton_cpp: hyperparameters must be a contiguous float64 vector of the slots of constants.py");
  return hp.data_ptr<double>();
}

}  // namespace

std::vector<at::Tensor> loss_forward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                                     const at::Tensor& target, const at::Tensor& temperature,
                                     const std::optional<at::Tensor>& old_logp, const at::Tensor& advantages,
                                     const at::Tensor& w_pg, const at::Tensor& w_kl, const at::Tensor& w_ent,
                                     const std::optional<at::Tensor>& ref_logp, const at::Tensor& hyperparameters,
                                     const std::string& loss_type, const std::string& estimator,
                                     bool straight_through, bool entropy_grad, bool with_grad, bool with_entropy) {
  int64_t N, V;  // plain variables, not a structured binding: the parallel lambdas capture them
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const LossParams P(loss_type, estimator, straight_through, hyperparameters_ptr(hyperparameters));
  const bool has_ref = ref3d.has_value(), full = P.estimator == kFull;
  TORCH_CHECK(!full || has_ref, "kltriton_cpp: the full KL needs ref_logits");
  TORCH_CHECK(P.estimator == kNoKl || has_ref || ref_logp.has_value(), "kltriton_cpp: the KL needs a reference");
  if (has_ref) {
    check_rows3d(*ref3d, "ref_logits");
    TORCH_CHECK(ref3d->size(0) * ref3d->size(1) == N && ref3d->size(2) == V && ref3d->scalar_type() ==
                logits3d.scalar_type(), "kltriton_cpp: ref_logits must have the shape and dtype of logits");
  }
  const RowIn in{f32_ptr(old_logp, N, "old_logp"), f32_ptr(advantages, N, "advantages"),
                 f32_ptr(w_pg, N, "w_pg"), f32_ptr(w_kl, N, "w_kl"), f32_ptr(w_ent, N, "w_ent"),
                 has_ref ? nullptr : f32_ptr(ref_logp, N, "ref_logp")};

  TORCH_CHECK(with_entropy || !entropy_grad, "kltriton_cpp: an entropy gradient needs the entropy");
  const int fmode = (with_entropy ? kEntropy : 0) | (has_ref ? kRef : 0) | (full ? kFullKl : 0);
  const auto f32 = logits3d.options().dtype(at::kFloat);
  // The statistics, one empty tensor for every one `fmode` does not compute (each distinct tensor returned costs the
  // Python caller ~0.7 us), then the gradient.
  const at::Tensor absent = at::empty({0}, f32);
  std::vector<at::Tensor> outs;
  float* out[kNumStats];
  for (int i = 0; i < kNumStats; ++i) {
    const bool present = stat_present(i, fmode);
    outs.push_back(present ? at::empty({N}, f32) : absent);
    out[i] = present ? outs.back().data_ptr<float>() : nullptr;
  }
  outs.push_back(with_grad ? gradient_buffer(N, V, logits3d.options()) : at::empty({0, V}, logits3d.options()));
  if (N == 0) return outs;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  const int bmode = (entropy_grad || full ? kPLogp : 0) | (full ? kPLogq : 0);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* g = with_grad ? outs.back().data_ptr<T>() : nullptr;
    with_mode<0, kRef, kRef | kFullKl, kEntropy, kEntropy | kRef, kEntropy | kRef | kFullKl>(fmode, [&](auto fm) {
      with_mode<0, kPLogp, kPLogp | kPLogq>(bmode, [&](auto bm) {
        constexpr int F = decltype(fm)::value, B = decltype(bm)::value;
        if constexpr ((B & kPLogq) == 0 || (F & kFullKl) != 0) {
          run_loss<T, F, B>(logits3d, ref3d, tgt, N, V, temp, P, in, entropy_grad, out, g);
        } else {
          TORCH_CHECK(false, "kltriton_cpp: inconsistent loss modes");
        }
      });
    });
  });
  return outs;
}

// The label side's target and the loss's row weights (layout_weights), the fused loss at them (loss_forward), then its
// per-token terms and metrics (loss_terms), in one call from Python: each call through torch.ops costs the host a few
// microseconds, more than the three kernels at small N. Returns the target, the statistics and the gradient as
// loss_forward, then the loss, kl, ratio and metrics as loss_terms.
std::vector<at::Tensor> loss_forward_labels(
    const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d, const at::Tensor& labels2d,
    const std::optional<at::Tensor>& mask2d, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& checked_temperature, int64_t ignore_index, bool shift,
    const std::optional<at::Tensor>& flags, int64_t aggregation, const std::optional<at::Tensor>& num_tokens,
    const std::optional<at::Tensor>& num_seqs_agg, const std::optional<at::Tensor>& horizon,
    const std::optional<at::Tensor>& advantages, bool per_sequence, double kl_coef, double entropy_coef,
    const at::Tensor& temperature, const std::optional<at::Tensor>& old_logp,
    const std::optional<at::Tensor>& ref_logp, const at::Tensor& hyperparameters, const std::string& loss_type,
    const std::string& estimator, bool straight_through, bool entropy_grad, bool with_grad, bool with_entropy) {
  const std::vector<at::Tensor> made =
      layout_weights(labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, logits3d.size(2), shift, flags,
                     aggregation, num_tokens, num_seqs_agg, horizon, advantages, per_sequence, kl_coef, entropy_coef);
  const at::Tensor& target = made[0];
  const at::Tensor adv = made[1][0], w_agg = made[1][1], w_pg = made[1][2], w_kl = made[1][3], w_ent = made[1][4];
  // the given per-row log-probs as the kernels read them: flat contiguous float32
  auto rows = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value()) return std::nullopt;
    return t->reshape(-1).to(at::kFloat).contiguous();
  };
  const std::optional<at::Tensor> old = rows(old_logp), given_ref = rows(ref_logp);
  std::vector<at::Tensor> out = loss_forward(logits3d, ref3d, target, temperature, old, adv, w_pg, w_kl, w_ent,
                                             given_ref, hyperparameters, loss_type, estimator, straight_through,
                                             entropy_grad, with_grad, with_entropy);
  const int64_t N = target.numel();
  auto present = [N](const at::Tensor& t) -> std::optional<at::Tensor> {
    return t.numel() == N && N > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  const bool ref_given = !ref3d.has_value();
  const std::vector<at::Tensor> terms =
      loss_terms(out[kStatLogp], ref_given ? given_ref : std::optional<at::Tensor>(out[kStatRefLogp]), ref_given,
                 present(out[kStatFullKl]), present(out[kStatEntropy]), target, old, adv, w_pg, w_kl, w_ent, w_agg,
                 hyperparameters, loss_type, estimator, straight_through);
  out.insert(out.begin(), target);
  out.insert(out.end(), terms.begin(), terms.end());
  return out;
}

at::Tensor loss_coefficients(const at::Tensor& logp, const at::Tensor& ref_logp,
                             const std::optional<at::Tensor>& old_logp, const at::Tensor& advantages,
                             const at::Tensor& w_pg, const at::Tensor& w_kl, const std::optional<at::Tensor>& full_kl,
                             const at::Tensor& hyperparameters, const std::string& loss_type,
                             const std::string& estimator, bool straight_through) {
  const int64_t N = logp.numel();
  const LossParams P(loss_type, estimator, straight_through, hyperparameters_ptr(hyperparameters));
  const RowIn in{f32_ptr(old_logp, N, "old_logp"), f32_ptr(advantages, N, "advantages"), f32_ptr(w_pg, N, "w_pg"),
                 f32_ptr(w_kl, N, "w_kl"), nullptr, nullptr};
  const float* lp = f32_ptr(logp, N, "logp");
  const float* rlp = f32_ptr(ref_logp, N, "ref_logp");
  const float* fkl = f32_ptr(full_kl, N, "full_kl");
  at::Tensor g = at::empty({N}, logp.options());
  float* out = g.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) out[n] = static_cast<float>(row_g_logp(P, in, n, lp[n], rlp[n], fkl ? fkl[n] : 0.f).logp);
  return g;
}

void loss_accumulate_(at::Tensor& grad, const at::Tensor& logits3d, const at::Tensor& target,
                      const at::Tensor& temperature, const at::Tensor& lse, const at::Tensor& c_label,
                      const at::Tensor& c_p, const std::optional<at::Tensor>& c_p_logp) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  TORCH_CHECK(grad.is_contiguous() && grad.numel() == N * V && grad.scalar_type() == logits3d.scalar_type(),
              "kltriton_cpp: grad must be a contiguous [N, V] tensor of the logits' dtype");
  const float* lse_p = f32_ptr(lse, N, "lse");
  const float* cl = f32_ptr(c_label, N, "c_label");
  const float* cp = f32_ptr(c_p, N, "c_p");
  const float* cpl = f32_ptr(c_p_logp, N, "c_p_logp");
  if (N == 0) return;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  const Rows3d X(logits3d);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* g = grad.data_ptr<T>();
    auto rows = [&](auto mode) {
      constexpr int B = decltype(mode)::value;
      at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const float pl = cpl ? cpl[n] : 0.f;
          // A row with nothing to add is not read: the entropy mask touches its kept rows only.
          if (tgt[n] < 0 || tgt[n] >= V || !std::isfinite(lse_p[n]) || (cl[n] == 0.f && cp[n] == 0.f && pl == 0.f))
            continue;
          const RowCoef k = row_coef(temp, n, lse_p[n], 0.f, cl[n], cp[n], pl, 0.f);
          backward_row<T, T, B, false, true>(X.row<T>(n), nullptr, g + n * V, V, tgt[n], k);
        }
      });
    };
    if (cpl) {
      rows(std::integral_constant<int, kPLogp>{});
    } else {
      rows(std::integral_constant<int, 0>{});
    }
  });
}

void loss_scale_(at::Tensor& grad, const at::Tensor& upstream) {
  TORCH_CHECK(upstream.numel() == 1 && upstream.device().is_cpu(), "kltriton_cpp: upstream must be a CPU scalar");
  const double u = upstream.item<double>();  // host memory: no device sync
  if (u != 1.0 && grad.numel() > 0) grad.mul_(u);
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("loss_forward", &kltriton_cpp::loss_forward);
  m.impl("loss_forward_labels", &kltriton_cpp::loss_forward_labels);
  m.impl("loss_coefficients", &kltriton_cpp::loss_coefficients);
  m.impl("loss_accumulate_", &kltriton_cpp::loss_accumulate_);
  m.impl("loss_scale_", &kltriton_cpp::loss_scale_);
}
