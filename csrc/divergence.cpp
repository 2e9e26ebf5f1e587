// The divergence family's ops on the CPU: the generalized JSD's second pass and its gradient (row_mixture.h),
// rows in parallel.
#include <torch/library.h>

#include "row_backward.h"
#include "row_mixture.h"

namespace kltriton_cpp {
namespace {

struct JsdInputs {
  const int64_t* tgt;
  const float *lse, *rlse, *kl_student, *coef;
  double beta;
};

// Whether row n is scored and has both distributions (finite log-sum-exps).
inline bool jsd_live(const JsdInputs& in, int64_t n, int64_t V) {
  const int64_t tg = in.tgt[n];
  return tg >= 0 && tg < V && std::isfinite(in.lse[n]) && std::isfinite(in.rlse[n]);
}

inline MixtureRow mixture_row(const Temperatures& temp, const JsdInputs& in, int64_t n) {
  float hi;
  double lo;
  temp.inverse(n, hi, lo);
  return MixtureRow{hi, static_cast<float>(lo), in.lse[n], in.rlse[n], static_cast<float>(in.beta),
                    static_cast<float>(1.0 - in.beta)};
}

const float* rows_f32(const at::Tensor& t, int64_t N, const char* name, at::Tensor& keep) {
  TORCH_CHECK(t.numel() == N, "kltriton_cpp: ", name, " must have one entry per row");
  keep = t.to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// The checks shared by both ops; fills the row inputs.
std::pair<int64_t, int64_t> jsd_inputs(const at::Tensor& logits3d, const at::Tensor& ref3d, const at::Tensor& target,
                                       const at::Tensor& temperature, const at::Tensor& lse,
                                       const at::Tensor& ref_lse, const at::Tensor& beta, JsdInputs& in,
                                       at::Tensor* keep) {
  const auto [N, V] = check_stream_args(logits3d, target, temperature);
  check_rows3d(ref3d, "ref_logits");
  TORCH_CHECK(ref3d.size(0) * ref3d.size(1) == N && ref3d.size(2) == V,
              "kltriton_cpp: ref_logits must have the shape of logits");
  TORCH_CHECK(beta.numel() == 1 && beta.scalar_type() == at::kDouble && beta.device().is_cpu(),
              "kltriton_cpp: beta must be a float64 CPU scalar");
  in.tgt = target.data_ptr<int64_t>();
  in.lse = rows_f32(lse, N, "lse", keep[0]);
  in.rlse = rows_f32(ref_lse, N, "ref_lse", keep[1]);
  in.beta = beta.item<double>();  // host memory: no device sync
  return {N, V};
}

}  // namespace

std::vector<at::Tensor> jsd_forward(const at::Tensor& logits3d, const at::Tensor& ref3d, const at::Tensor& target,
                                    const at::Tensor& temperature, const at::Tensor& lse, const at::Tensor& ref_lse,
                                    const at::Tensor& beta) {
  JsdInputs in{};
  at::Tensor keep[2];
  int64_t N, V;  // plain variables, not a structured binding: the parallel lambdas capture them
  std::tie(N, V) = jsd_inputs(logits3d, ref3d, target, temperature, lse, ref_lse, beta, in, keep);
  const auto f32 = logits3d.options().dtype(at::kFloat);
  at::Tensor jsd = at::empty({N}, f32), kl_student = at::empty({N}, f32);
  if (N == 0) return {jsd, kl_student};
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  float* out_jsd = jsd.data_ptr<float>();
  float* out_kl = kl_student.data_ptr<float>();
  with_dtypes(logits3d.scalar_type(), ref3d, [&](auto tag, auto ref_tag) {
    using T = typename decltype(tag)::type;
    using R = typename decltype(ref_tag)::type;
    const Rows3d X(logits3d), Y(ref3d);
    at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        if (!jsd_live(in, n, V)) {
          const float v = in.tgt[n] == kSkip ? 0.f : kNaN;
          out_jsd[n] = v;
          out_kl[n] = v;
          continue;
        }
        const auto [kl_p, kl_q] = jsd_forward_row<T, R>(X.row<T>(n), Y.row<R>(n), V, mixture_row(temp, in, n));
        out_jsd[n] = static_cast<float>(nonnegative(in.beta * kl_q + (1.0 - in.beta) * kl_p));
        out_kl[n] = static_cast<float>(kl_p);
      }
    });
  });
  return {jsd, kl_student};
}

at::Tensor jsd_backward(const at::Tensor& logits3d, const at::Tensor& ref3d, const at::Tensor& target,
                        const at::Tensor& temperature, const at::Tensor& lse, const at::Tensor& ref_lse,
                        const at::Tensor& beta, const at::Tensor& kl_student, const at::Tensor& coef) {
  JsdInputs in{};
  at::Tensor keep[4];
  int64_t N, V;
  std::tie(N, V) = jsd_inputs(logits3d, ref3d, target, temperature, lse, ref_lse, beta, in, keep);
  in.kl_student = rows_f32(kl_student, N, "kl_student", keep[2]);
  in.coef = rows_f32(coef, N, "coef", keep[3]);
  at::Tensor grad = gradient_buffer(N, V, logits3d.options());
  if (N == 0) return grad;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  with_dtypes(logits3d.scalar_type(), ref3d, [&](auto tag, auto ref_tag) {
    using T = typename decltype(tag)::type;
    using R = typename decltype(ref_tag)::type;
    const Rows3d X(logits3d), Y(ref3d);
    T* gbase = grad.data_ptr<T>();
    at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        T* g = gbase + n * V;
        if (!jsd_live(in, n, V)) {
          zero_row(g, V);
          continue;
        }
        jsd_backward_row<T, R>(X.row<T>(n), Y.row<R>(n), g, V, mixture_row(temp, in, n), in.kl_student[n],
                               in.coef[n]);
      }
    });
  });
  return grad;
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("jsd_forward", &kltriton_cpp::jsd_forward);
  m.impl("jsd_backward", &kltriton_cpp::jsd_backward);
}
