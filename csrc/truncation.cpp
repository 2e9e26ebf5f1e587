// The truncation family's ops on the CPU: truncated_forward finds each row's floor (truncation.h) and, the row
// still in cache, its statistics restricted to the kept set (forward_row with FLOOR); truncated_backward writes
// the gradient of those restricted rows (backward_row with FLOOR). Rows in parallel.
#include "row_backward.h"
#include "row_forward.h"
#include "truncation.h"

namespace kltriton_cpp {

std::vector<at::Tensor> truncated_forward(const at::Tensor& logits3d, const at::Tensor& target,
                                          const at::Tensor& temperature, const at::Tensor& top_k,
                                          const at::Tensor& top_p, const at::Tensor& min_p,
                                          const std::optional<at::Tensor>& floor, int64_t wanted) {
  int64_t N, V;  // plain variables: the parallel lambdas capture them
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  TORCH_CHECK((wanted & ~static_cast<int64_t>(kEntropy)) == 0, "kltriton_cpp: truncated_forward computes logp, "
              "lse and entropy only");
  const bool given = floor.has_value();
  if (given) {
    TORCH_CHECK(floor->scalar_type() == at::kFloat && floor->is_contiguous() && floor->numel() == N,
                "kltriton_cpp: floor must be a contiguous float32 tensor with one entry per row");
  } else {
    TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == N &&
                    top_p.scalar_type() == at::kDouble && top_p.is_contiguous() && top_p.numel() == N &&
                    min_p.scalar_type() == at::kDouble && min_p.is_contiguous() && min_p.numel() == N,
                "kltriton_cpp: top_k (int64), top_p and min_p (float64) need one contiguous entry per row");
  }
  const auto f32 = logits3d.options().dtype(at::kFloat);
  at::Tensor floors = given ? *floor : at::empty({N}, f32);
  std::vector<at::Tensor> outs{floors};
  float* out[kNumStats];
  for (int i = 0; i < kNumStats; ++i) {
    const bool present = stat_present(i, wanted) && i != kStatRefLogp && i != kStatRefLse && i != kStatFullKl;
    outs.push_back(at::empty({present ? N : 0}, f32));
    out[i] = present ? outs.back().data_ptr<float>() : nullptr;
  }
  if (N == 0) return outs;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  float* fl = floors.data_ptr<float>();
  const int64_t* kk = given ? nullptr : top_k.data_ptr<int64_t>();
  const double* pp = given ? nullptr : top_p.data_ptr<double>();
  const double* mp = given ? nullptr : min_p.data_ptr<double>();
  const Rows3d X(logits3d);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_mode<0, kEntropy>(static_cast<int>(wanted), [&](auto m) {
      constexpr int MODE = decltype(m)::value;
      at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
        std::vector<float> cand;
        for (int64_t n = begin; n < end; ++n) {
          const int64_t tg = tgt[n];
          RowOut r;
          if (tg < 0 || tg >= V) {
            if (!given) fl[n] = -kInf;
            r = skipped_row(tg);
          } else {
            float hi;
            double lo;
            temp.inverse(n, hi, lo);
            const T* x = X.row<T>(n);
            if (!given) fl[n] = row_floor<T>(x, V, temp.t[temp.per_row ? n : 0], Knobs{kk[n], pp[n], mp[n]}, cand);
            r = forward_row<T, T, MODE, true>(x, nullptr, V, tg, hi, lo, fl[n]);
          }
          for (int i = 0; i < kNumStats; ++i) {
            if (out[i] != nullptr) out[i][n] = r.v[i];
          }
        }
      });
    });
  });
  return outs;
}

at::Tensor truncated_backward(const at::Tensor& logits3d, const at::Tensor& target, const at::Tensor& temperature,
                              const at::Tensor& floor, const at::Tensor& lse, const at::Tensor& c_label,
                              const at::Tensor& c_p, const std::optional<at::Tensor>& c_p_logp) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  auto rows = [N](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.numel() == N, "kltriton_cpp: ", name, " must have one entry per row");
    return t.to(at::kFloat).contiguous();
  };
  const at::Tensor fl = rows(floor, "floor"), ls = rows(lse, "lse"), cl = rows(c_label, "c_label"),
                   cp = rows(c_p, "c_p");
  const at::Tensor cpl = c_p_logp.has_value() ? rows(*c_p_logp, "c_p_logp") : at::Tensor();
  at::Tensor grad = gradient_buffer(N, V, logits3d.options());
  if (N == 0) return grad;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  const float *pf = fl.data_ptr<float>(), *pl = ls.data_ptr<float>(), *pcl = cl.data_ptr<float>(),
              *pcp = cp.data_ptr<float>(), *pcpl = cpl.defined() ? cpl.data_ptr<float>() : nullptr;
  const Rows3d X(logits3d);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* gbase = grad.data_ptr<T>();
    with_mode<0, kPLogp>(pcpl != nullptr ? kPLogp : 0, [&](auto m) {
      constexpr int MODE = decltype(m)::value;
      at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          T* g = gbase + n * V;
          const int64_t tg = tgt[n];
          if (tg < 0 || tg >= V || !std::isfinite(pl[n]) || std::isnan(pf[n])) {
            zero_row(g, V);
            continue;
          }
          const RowCoef k = row_coef(temp, n, pl[n], 0.f, pcl[n], pcp[n], pcpl != nullptr ? pcpl[n] : 0.f, 0.f);
          backward_row<T, T, MODE, true>(X.row<T>(n), static_cast<const T*>(nullptr), g, V, tg, k, pf[n]);
        }
      });
    });
  });
  return grad;
}

}  // namespace kltriton_cpp
