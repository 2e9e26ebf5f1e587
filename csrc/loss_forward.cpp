// Policy loss with the gradient produced in the forward (family `loss`, kltriton/kernels/loss/).
//
// Per row of [A, B, V] logits, while the row stays in L1/L2: the streaming statistics pass of
// stream_forward.cpp (log-prob, entropy, reference log-prob, full KL), then the row's loss
// coefficients d loss / d logp, d loss / d entropy, d loss / d full_kl from row-local values and
// per-row weights computed before the kernel, then the gradient pass of stream_backward.cpp on the
// same row. The logits are read from memory once and the gradient written once.
//
// The row kernels are compiled into this translation unit from the stream sources (their public
// entry points are left out by KLTRITON_ROW_KERNELS_ONLY), so there is one copy of the math.
#define KLTRITON_ROW_KERNELS_ONLY
#include "stream_forward.cpp"
#include "stream_backward.cpp"
#undef KLTRITON_ROW_KERNELS_ONLY

namespace kltriton_cpp {
namespace {

// Loss types and KL estimators, numbered as in kltriton/kernels/loss/cpp.py.
enum LossType : int64_t { kPpo = 0, kCispo = 1 };
enum Estimator : int64_t { kNoKl = 0, kK1 = 1, kAbs = 2, kK2 = 3, kK3 = 4, kFull = 5 };
constexpr double kLogRatioClamp = 20.0;  // verl clamps log(ratio) to [-20, 20] before exp

struct Params {
  int64_t loss_type, estimator;
  bool straight_through;
  double ratio_low, ratio_high, dual_clip, kl_clamp;  // dual_clip / kl_clamp: +inf when off
};

struct RowIn {
  const float *old, *adv, *wpg, *wkl, *went, *rlogp;  // old / rlogp: nullptr when absent
};

struct Coef {
  float gl, ge, gk;  // d loss / d (logp, entropy, full_kl)
};

// d loss_n / d (logp, entropy, full_kl) of one row: the derivative of
//   w_pg * pg(logp) + w_kl * kl(logp) + w_ent * entropy
// (kltriton/kernels/loss/terms.py: `objective`, and `coefficients`, its derivative in PyTorch for
// the other backends; at an exact tie of max / min the unclipped branch takes the whole gradient).
inline Coef row_coefficients(const Params& P, const RowIn& in, int64_t n, double lp, double rlp) {
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
  double g_kl = 0.0;
  if (P.estimator == kFull) {
    g_kl = in.wkl[n];
  } else if (P.estimator != kNoKl) {
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
  return Coef{static_cast<float>(g_lp), in.went[n], P.estimator == kFull ? static_cast<float>(g_kl) : 0.f};
}

template <typename T, int FMODE, int BMODE>
void run_loss(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d, const int64_t* tgt, int64_t N,
              int64_t V, const Temperatures& temp, const Params& P, const RowIn& in, float* logp, float* ent,
              float* rlogp, float* fkl, T* grad) {
  constexpr bool REF = FMODE & kRef, KL = FMODE & kFullKl;
  const Rows3d X(logits3d);
  const Rows3d Y = REF ? Rows3d(*ref3d) : Rows3d();
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t tg = tgt[n];
      T* g = grad ? grad + n * V : nullptr;
      RowOut r;
      float hi;
      double lo;
      temp.inverse(n, hi, lo);
      if (tg < 0 || tg >= V) {
        const float v = tg == kSkip ? 0.f : kNaN;
        r = RowOut{v, 0.f, v, v, 0.f, v};
      } else {
        r = forward_row<T, T, FMODE>(X.row<T>(n), REF ? Y.row<T>(n) : nullptr, V, tg, hi, lo);
      }
      logp[n] = r.logp;
      ent[n] = r.entropy;
      if constexpr (REF) rlogp[n] = r.ref_logp;
      if constexpr (KL) fkl[n] = r.full_kl;
      if (g == nullptr) continue;
      if (tg < 0 || tg >= V || !std::isfinite(r.lse)) {
        std::memset(static_cast<void*>(g), 0, sizeof(T) * V);
        continue;
      }
      const double rlp = REF ? r.ref_logp : (in.rlogp ? in.rlogp[n] : 0.f);
      const Coef c = row_coefficients(P, in, n, r.logp, rlp);
      const RowCoef k = row_coef(temp, n, r.lse, r.ref_lse, c.gl, (BMODE & kEntropy) ? c.ge : 0.f, r.entropy,
                                 c.gk, r.full_kl);
      backward_row<T, T, BMODE>(X.row<T>(n), (BMODE & kFullKl) ? Y.row<T>(n) : nullptr, g, V, tg, k);
    }
  });
}

const float* f32_ptr(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N,
              "kltriton_cpp: ", name, " must be a contiguous float32 tensor with one entry per row");
  return t->data_ptr<float>();
}

}  // namespace

std::vector<at::Tensor> loss_forward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                                     const at::Tensor& target, const at::Tensor& temperature,
                                     const std::optional<at::Tensor>& old_logp, const at::Tensor& advantages,
                                     const at::Tensor& w_pg, const at::Tensor& w_kl, const at::Tensor& w_ent,
                                     const std::optional<at::Tensor>& ref_logp, const at::Tensor& bounds,
                                     int64_t loss_type, int64_t estimator, bool straight_through,
                                     bool entropy_grad, bool with_grad) {
  int64_t N, V;  // plain variables, not a structured binding: the parallel lambdas capture them
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const bool has_ref = ref3d.has_value(), full = estimator == kFull;
  TORCH_CHECK(!full || has_ref, "kltriton_cpp: the full KL needs ref_logits");
  TORCH_CHECK(loss_type == kPpo || loss_type == kCispo, "kltriton_cpp: unknown loss type ", loss_type);
  TORCH_CHECK(estimator >= kNoKl && estimator <= kFull, "kltriton_cpp: unknown estimator ", estimator);
  TORCH_CHECK(estimator == kNoKl || has_ref || ref_logp.has_value(), "kltriton_cpp: the KL needs a reference");
  if (has_ref) {
    check_rows3d(*ref3d, "ref_logits");
    TORCH_CHECK(ref3d->size(0) * ref3d->size(1) == N && ref3d->size(2) == V && ref3d->scalar_type() ==
                logits3d.scalar_type(), "kltriton_cpp: ref_logits must have the shape and dtype of logits");
  }
  TORCH_CHECK(bounds.scalar_type() == at::kDouble && bounds.is_contiguous() && bounds.numel() == 4,
              "kltriton_cpp: bounds must be float64 [ratio_low, ratio_high, dual_clip, kl_clamp]");
  const double* b = bounds.data_ptr<double>();
  const Params P{loss_type, estimator, straight_through, b[0], b[1], b[2], b[3]};
  const RowIn in{f32_ptr(old_logp, N, "old_logp"), f32_ptr(advantages, N, "advantages"),
                 f32_ptr(w_pg, N, "w_pg"), f32_ptr(w_kl, N, "w_kl"), f32_ptr(w_ent, N, "w_ent"),
                 has_ref ? nullptr : f32_ptr(ref_logp, N, "ref_logp")};

  const auto f32 = logits3d.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, f32), ent = at::empty({N}, f32);
  at::Tensor rlogp = at::empty({has_ref ? N : 0}, f32), fkl = at::empty({full ? N : 0}, f32);
  at::Tensor grad = with_grad ? gradient_buffer(N, V, logits3d.options()) : at::empty({0, V}, logits3d.options());
  if (N == 0) return {logp, ent, rlogp, fkl, grad};
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  const int fmode = kEntropy | (has_ref ? kRef : 0) | (full ? kFullKl : 0);
  const int bmode = (entropy_grad ? kEntropy : 0) | (full ? kRef | kFullKl : 0);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* g = with_grad ? grad.data_ptr<T>() : nullptr;
    float* o[4] = {logp.data_ptr<float>(), ent.data_ptr<float>(), has_ref ? rlogp.data_ptr<float>() : nullptr,
                   full ? fkl.data_ptr<float>() : nullptr};
    with_mode<kEntropy, kEntropy | kRef, kEntropy | kRef | kFullKl>(fmode, [&](auto fm) {
      with_mode<0, kEntropy, kRef | kFullKl, kRef | kFullKl | kEntropy>(bmode, [&](auto bm) {
        constexpr int F = decltype(fm)::value, B = decltype(bm)::value;
        if constexpr ((B & kFullKl) == 0 || (F & kFullKl) != 0) {
          run_loss<T, F, B>(logits3d, ref3d, tgt, N, V, temp, P, in, o[0], o[1], o[2], o[3], g);
        } else {
          TORCH_CHECK(false, "kltriton_cpp: inconsistent loss modes");
        }
      });
    });
  });
  return {logp, ent, rlogp, fkl, grad};
}

void loss_scale_(at::Tensor& grad, const at::Tensor& upstream) {
  TORCH_CHECK(upstream.numel() == 1 && upstream.device().is_cpu(), "kltriton_cpp: upstream must be a CPU scalar");
  const double u = upstream.to(at::kDouble).item<double>();  // host memory: no device sync
  if (u != 1.0 && grad.numel() > 0) grad.mul_(u);
}

}  // namespace kltriton_cpp
