// The stream family's backward op on the CPU: each row's gradient by the row kernel of row_backward.h
// from the row's basis coefficients, rows in parallel, into one [N, V] gradient (gradient_buffer.cpp).
#include <torch/library.h>

#include "row_backward.h"

namespace kltriton_cpp {
namespace {

struct Inputs {
  const int64_t* tgt;
  const float *lse, *rlse;
  const float* basis[kNumBasis];  // by GRADIENT_BASIS index; nullptr: the term is absent
};

template <typename T, typename R, int MODE>
void run_backward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d, const Inputs& in,
                  at::Tensor& grad, const Temperatures& temp) {
  const int64_t N = grad.size(0), V = grad.size(1);
  const Rows3d X(logits3d);
  constexpr bool READS_Y = ReadsReference<MODE>::value;
  const Rows3d Y = READS_Y ? Rows3d(*ref3d) : Rows3d();
  T* gbase = grad.data_ptr<T>();
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* g = gbase + n * V;
      const int64_t tg = in.tgt[n];
      const float lse = in.lse[n];
      if (tg < 0 || tg >= V || !std::isfinite(lse)) {
        zero_row(g, V);
        continue;
      }
      const RowCoef k = row_coef(temp, n, lse, READS_Y ? in.rlse[n] : 0.f, in.basis);
      backward_row<T, R, MODE>(X.row<T>(n), READS_Y ? Y.row<R>(n) : nullptr, g, V, tg, k);
    }
  });
}

// A per-row float32 input as a contiguous tensor (kept alive by the caller) and its data.
const float* f32_rows(const at::Tensor& t, int64_t N, const char* name, at::Tensor& keep) {
  TORCH_CHECK(t.numel() == N, "kltriton_cpp: ", name, " must have one entry per row");
  keep = t.to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// The gradient from the basis terms `in.basis` (mode: the optional terms present, one bit each after label and p).
// out: where to write it ([N, V] contiguous, the logits' dtype; it may be the logits themselves), or a new buffer.
at::Tensor backward_on_basis(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                             const at::Tensor& target, const at::Tensor& temperature, const at::Tensor& lse,
                             const std::optional<at::Tensor>& ref_lse, Inputs& in, int mode, int64_t N, int64_t V,
                             const std::optional<at::Tensor>& out = std::nullopt) {
  const bool with_ref = (mode & KLTRITON_BASIS_NEEDS_REF) != 0;
  at::Tensor keep_lse, keep_rlse;
  in.tgt = target.data_ptr<int64_t>();
  in.lse = f32_rows(lse, N, "lse", keep_lse);
  if (with_ref) {
    TORCH_CHECK(ref3d.has_value() && ref_lse.has_value(),
                "kltriton_cpp: the basis terms of the reference need ref_logits and ref_lse");
    check_rows3d(*ref3d, "ref_logits");
    TORCH_CHECK(ref3d->size(0) * ref3d->size(1) == N && ref3d->size(2) == V,
                "kltriton_cpp: ref_logits must have the shape of logits");
    in.rlse = f32_rows(*ref_lse, N, "ref_lse", keep_rlse);
  }
  TORCH_CHECK(!out.has_value() || (out->is_contiguous() && out->numel() == N * V &&
                                    out->scalar_type() == logits3d.scalar_type()),
              "kltriton_cpp: out must be a contiguous [N, V] tensor of the logits' dtype");
  at::Tensor grad = out.has_value() ? out->view({N, V}) : gradient_buffer(N, V, logits3d.options());
  if (N == 0) return grad;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  // The reference is read only for the terms that need it.
  const std::optional<at::Tensor> ref_read = with_ref ? ref3d : std::nullopt;
  with_dtypes(logits3d.scalar_type(), ref_read, [&](auto tag, auto ref_tag) {
    using T = typename decltype(tag)::type;
    using R = typename decltype(ref_tag)::type;
    if (with_ref) {
      with_any_mode<kBasisLimit, ReadsReference>(mode, [&](auto m) {
        run_backward<T, R, decltype(m)::value>(logits3d, ref3d, in, grad, temp);
      });
    } else if constexpr (std::is_same_v<T, R>) {
      with_any_mode<kBasisLimit, IgnoresReference>(mode, [&](auto m) {
        run_backward<T, T, decltype(m)::value>(logits3d, ref3d, in, grad, temp);
      });
    }
  });
  return grad;
}

// The upstream gradients of the differentiable statistics and the statistics' values their terms read, in the
// order of stream_backward_upstream's list (kltriton/kernels/stream/__init__.py Upstream).
enum UpstreamSlot : int { kGLogp, kGEntropy, kGFullKl, kGForwardKl, kEntropyValue, kFullKlValue, kNumUpstream };

// The basis of upstream gradients, per row in double and divided by T (kltriton/kernels/statistics.py
// gradient_basis): label = g_logp; p = g_logp + g_entropy H + g_full_kl KL - g_forward_kl (a zero gradient adds
// nothing even where its statistic is infinite); p_logp = g_entropy - g_full_kl; p_logq = g_full_kl; q = g_forward_kl.
void basis_of_upstream(const float* const* up, const Temperatures& temp, int64_t N, std::vector<float>* terms,
                       bool* present) {
  present[KLTRITON_BASIS_LABEL] = present[KLTRITON_BASIS_P] = true;
  present[KLTRITON_BASIS_P_LOGP] = up[kGEntropy] != nullptr || up[kGFullKl] != nullptr;
  present[KLTRITON_BASIS_P_LOGQ] = up[kGFullKl] != nullptr;
  present[KLTRITON_BASIS_Q] = up[kGForwardKl] != nullptr;
  for (int i = 0; i < kNumBasis; ++i) terms[i].assign(present[i] ? N : 0, 0.f);
  const auto times = [](double g, double value) { return g == 0.0 ? 0.0 : g * value; };
  for (int64_t n = 0; n < N; ++n) {
    float hi;
    double lo;
    temp.inverse(n, hi, lo);
    const double inv = static_cast<double>(hi) + lo;
    const double gl = up[kGLogp] ? up[kGLogp][n] : 0.0;
    double p = gl, p_logp = 0.0;
    if (up[kGEntropy]) {
      const double g = up[kGEntropy][n];
      p += times(g, up[kEntropyValue][n]);
      p_logp += g;
    }
    if (up[kGFullKl]) {
      const double g = up[kGFullKl][n];
      p += times(g, up[kFullKlValue][n]);
      p_logp -= g;
      terms[KLTRITON_BASIS_P_LOGQ][n] = static_cast<float>(g * inv);
    }
    if (up[kGForwardKl]) {
      const double g = up[kGForwardKl][n];
      p -= g;
      terms[KLTRITON_BASIS_Q][n] = static_cast<float>(g * inv);
    }
    terms[KLTRITON_BASIS_LABEL][n] = static_cast<float>(gl * inv);
    terms[KLTRITON_BASIS_P][n] = static_cast<float>(p * inv);
    if (present[KLTRITON_BASIS_P_LOGP]) terms[KLTRITON_BASIS_P_LOGP][n] = static_cast<float>(p_logp * inv);
  }
}

}  // namespace

at::Tensor stream_backward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                           const at::Tensor& target, const at::Tensor& temperature, const at::Tensor& lse,
                           const std::optional<at::Tensor>& ref_lse,
                           const c10::List<std::optional<at::Tensor>>& basis) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  TORCH_CHECK(static_cast<int>(basis.size()) == kNumBasis && basis.get(KLTRITON_BASIS_LABEL).has_value() &&
                  basis.get(KLTRITON_BASIS_P).has_value(),
              "kltriton_cpp: the basis needs its ", kNumBasis, " terms, label and p given");
  int mode = 0;  // the optional terms present, one bit each after label and p
  for (int i = 2; i < kNumBasis; ++i) mode |= basis.get(i).has_value() ? 1 << (i - 2) : 0;
  Inputs in{};
  std::vector<at::Tensor> keep;
  rows_of<kNumBasis>(basis, N, in.basis, keep);
  return backward_on_basis(logits3d, ref3d, target, temperature, lse, ref_lse, in, mode, N, V);
}

// The same from the upstream gradients of the statistics (the basis computed here, per row: no [N] op outside).
at::Tensor stream_backward_upstream(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                                    const at::Tensor& target, const at::Tensor& temperature, const at::Tensor& lse,
                                    const std::optional<at::Tensor>& ref_lse,
                                    const c10::List<std::optional<at::Tensor>>& upstream,
                                    const std::optional<at::Tensor>& out) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const float* up[kNumUpstream];
  std::vector<at::Tensor> keep;
  rows_of<kNumUpstream>(upstream, N, up, keep);
  TORCH_CHECK((up[kGEntropy] == nullptr || up[kEntropyValue] != nullptr) &&
                  (up[kGFullKl] == nullptr || up[kFullKlValue] != nullptr),
              "kltriton_cpp: an entropy or full-KL gradient needs the statistic's value");
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  std::vector<float> terms[kNumBasis];
  bool present[kNumBasis];
  basis_of_upstream(up, temp, N, terms, present);
  Inputs in{};
  int mode = 0;
  for (int i = 0; i < kNumBasis; ++i) {
    in.basis[i] = present[i] ? terms[i].data() : nullptr;
    if (i >= 2 && present[i]) mode |= 1 << (i - 2);
  }
  return backward_on_basis(logits3d, ref3d, target, temperature, lse, ref_lse, in, mode, N, V, out);
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("stream_backward", &kltriton_cpp::stream_backward);
  m.impl("stream_backward_upstream", &kltriton_cpp::stream_backward_upstream);
}
