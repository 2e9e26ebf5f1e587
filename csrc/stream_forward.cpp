// The stream family's forward op on the CPU: each row's statistics by the row kernel of
// row_forward.h, rows in parallel, written to one output tensor per statistic. One variant per request
// (the statistics asked for), instantiated for every request the bits allow.
#include <torch/library.h>

#include "layout.h"
#include "row_forward.h"

namespace kltriton_cpp {
namespace {

template <typename T, typename R, int MODE>
void run_forward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d, const int64_t* tgt, int64_t N,
                 int64_t V, const Temperatures& temp, float* const* out) {
  constexpr bool REF = MODE & kRef;
  const Rows3d X(logits3d);
  const Rows3d Y = REF ? Rows3d(*ref3d) : Rows3d();
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t tg = tgt[n];
      RowOut r;
      if (tg < 0 || tg >= V) {
        r = skipped_row(tg);  // the row is never read
      } else {
        float hi;
        double lo;
        temp.inverse(n, hi, lo);
        r = forward_row<T, R, MODE>(X.row<T>(n), REF ? Y.row<R>(n) : nullptr, V, tg, hi, lo);
      }
      for (int i = 0; i < kNumStats; ++i) {
        if (out[i] != nullptr) out[i][n] = r.v[i];
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> stream_forward(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                                       const at::Tensor& target, const at::Tensor& temperature, int64_t wanted) {
  int64_t N, V;  // plain variables, not a structured binding: the parallel lambdas capture them
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const bool has_ref = ref3d.has_value();
  TORCH_CHECK(has_ref == ((wanted & kRef) != 0), "kltriton_cpp: the REF request bit must match ref_logits");
  TORCH_CHECK(!(wanted & kFullKl) || has_ref, "kltriton_cpp: the full KL needs ref_logits");
  if (has_ref) {
    check_rows3d(*ref3d, "ref_logits");
    TORCH_CHECK(ref3d->size(0) * ref3d->size(1) == N && ref3d->size(2) == V,
                "kltriton_cpp: ref_logits must have the shape of logits");
  }
  const auto f32 = logits3d.options().dtype(at::kFloat);
  // One empty tensor for every statistic `wanted` does not compute: each distinct tensor returned costs the Python
  // caller ~0.7 us.
  const at::Tensor absent = at::empty({0}, f32);
  std::vector<at::Tensor> stats;
  float* out[kNumStats];
  for (int i = 0; i < kNumStats; ++i) {
    const bool present = stat_present(i, wanted);
    stats.push_back(present ? at::empty({N}, f32) : absent);
    out[i] = present ? stats.back().data_ptr<float>() : nullptr;
  }
  if (N == 0) return stats;
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const int64_t* tgt = target.data_ptr<int64_t>();
  const int mode = static_cast<int>(wanted);
  with_dtypes(logits3d.scalar_type(), ref3d, [&](auto tag, auto ref_tag) {
    using T = typename decltype(tag)::type;
    using R = typename decltype(ref_tag)::type;
    if (has_ref) {
      with_any_mode<kRequestLimit, WithReference>(mode, [&](auto m) {
        run_forward<T, R, decltype(m)::value>(logits3d, ref3d, tgt, N, V, temp, out);
      });
    } else if constexpr (std::is_same_v<T, R>) {
      with_any_mode<kRequestLimit, WithoutReference>(mode, [&](auto m) {
        run_forward<T, T, decltype(m)::value>(logits3d, ref3d, tgt, N, V, temp, out);
      });
    }
  });
  return stats;
}

// The target from the label side (layout_target) and the statistics at it, in one call from Python: each call
// through torch.ops costs the host a few microseconds, more than both kernels at small N. Returns the target, then
// the statistics as stream_forward.
std::vector<at::Tensor> stream_forward_labels(const at::Tensor& logits3d, const std::optional<at::Tensor>& ref3d,
                                              const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                                              const std::optional<at::Tensor>& cu_seqlens,
                                              const std::optional<at::Tensor>& checked_temperature,
                                              int64_t ignore_index, bool shift, const std::optional<at::Tensor>& flags,
                                              const at::Tensor& temperature, int64_t wanted) {
  at::Tensor target = layout_target(labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index,
                                    logits3d.size(2), shift, flags);
  std::vector<at::Tensor> out = stream_forward(logits3d, ref3d, target, temperature, wanted);
  out.insert(out.begin(), target);
  return out;
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("stream_forward", &kltriton_cpp::stream_forward);
  m.impl("stream_forward_labels", &kltriton_cpp::stream_forward_labels);
}
