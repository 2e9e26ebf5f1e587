// The truncation family's ops on the CPU: truncated_forward finds each row's floor (truncation.h) and the
// statistics restricted to the kept set (forward_row with FLOOR over the gathered list that holds it, or over the
// row when the floor is given or nothing is cut); truncated_backward writes
// the gradient of those restricted rows (backward_row with FLOOR). Rows in parallel.
//
// Replay (Truncation(support=ids), kltriton/kernels/truncation/replay.py): replay_support puts each row's ids in
// canonical form, replay_columns gathers the logits there, replay_forward / replay_backward work on those K values,
// replay_scatter writes their gradient into the [N, V] gradient buffer.
#include <torch/library.h>

#include "row_backward.h"
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
        TruncationScratch scratch;
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
            int64_t kept = 0;
            if (!given) {
              fl[n] = row_floor<T>(x, V, temp.t[temp.per_row ? n : 0], Knobs{kk[n], pp[n], mp[n]}, scratch, &kept);
            }
            if (kept > 0) {  // the list holds every logit >= the floor; the label's logit goes after it
              scratch.list[kept] = static_cast<float>(x[tg]);
              r = forward_row<float, float, MODE, true>(scratch.list.data(), nullptr, kept, kept, hi, lo, fl[n]);
            } else {
              r = forward_row<T, T, MODE, true>(x, nullptr, V, tg, hi, lo, fl[n]);
            }
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

// --- replay ---------------------------------------------------------------------------------------------------
// Per row, in float64, each kept entry by the same scalar code wherever it sits: the row max m (exact), then
// d = (x - m) / T <= 0 and fixed-point sums of exp(d) and exp(d) * d in int64 units of 2^-KLTRITON_FIXED_POINT_BITS
// (each term truncated toward zero). Integer addition is associative, so the sums, and every output, do not depend
// on K (the padding), on the order of the ids or on the threads. The reference backend computes the same
// (kltriton/kernels/truncation/reference.py), with torch's exp.
namespace {

constexpr double kFixedUnit = static_cast<double>(int64_t{1} << KLTRITON_FIXED_POINT_BITS);

struct ReplayArgs {
  int64_t N, K;
  const float* x;
  const int64_t* ids;
  const int64_t* tgt;
  Temperatures temp;
};

ReplayArgs check_replay_args(const at::Tensor& values, const at::Tensor& ids, const at::Tensor& target,
                             const at::Tensor& temperature) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat && values.is_contiguous(),
              "kltriton_cpp: replay values must be a contiguous float32 [N, K] tensor");
  TORCH_CHECK(ids.sizes() == values.sizes() && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "kltriton_cpp: replay ids must be a contiguous int64 tensor shaped like the values");
  const int64_t N = values.size(0);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == N,
              "kltriton_cpp: target must be a contiguous int64 tensor with one entry per row");
  TORCH_CHECK(temperature.scalar_type() == at::kDouble && temperature.is_contiguous() &&
                  (temperature.numel() == 1 || temperature.numel() == N),
              "kltriton_cpp: temperature must be a contiguous float64 tensor with 1 or N entries");
  return {N, values.size(1), values.data_ptr<float>(), ids.data_ptr<int64_t>(), target.data_ptr<int64_t>(),
          Temperatures{temperature.data_ptr<double>(), temperature.numel() == N && N > 1}};
}

inline double row_temperature(const Temperatures& temp, int64_t n) { return temp.t[temp.per_row ? n : 0]; }

// Rows per parallel task: about 2^18 entries (a millisecond or so). A call with fewer runs on the calling thread:
// on a loaded machine, a parallel region costs a scheduler time slice (~20 ms measured on a shared 2-core VM) when
// one of its threads is descheduled, far more than this work.
inline int64_t replay_grain(int64_t K) { return std::max<int64_t>((int64_t{1} << 18) / std::max<int64_t>(K, 1), 1); }

}  // namespace

at::Tensor replay_support(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "kltriton_cpp: replay ids must be a contiguous int64 [N, K] tensor");
  const int64_t N = ids.size(0), K = ids.size(1);
  at::Tensor out = at::empty_like(ids);
  const int64_t* in = ids.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, N, replay_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t* row = po + n * K;
      int64_t* last = std::copy_if(in + n * K, in + (n + 1) * K, row, [](int64_t id) { return id >= 0; });
      std::sort(row, last);
      last = std::unique(row, last);
      std::fill(last, row + K, int64_t{-1});
    }
  });
  return out;
}

at::Tensor replay_columns(const at::Tensor& logits3d, const at::Tensor& ids) {
  check_rows3d(logits3d, "logits");
  const int64_t N = logits3d.size(0) * logits3d.size(1), V = logits3d.size(2);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == N && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "kltriton_cpp: replay ids must be a contiguous int64 [N, K] tensor, one row per logits row");
  const int64_t K = ids.size(1);
  at::Tensor out = at::empty({N, K}, logits3d.options().dtype(at::kFloat));
  const int64_t* pi = ids.data_ptr<int64_t>();
  float* po = out.data_ptr<float>();
  const Rows3d X(logits3d);
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::parallel_for(0, N, replay_grain(K), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const T* x = X.row<T>(n);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t id = pi[n * K + k];
          po[n * K + k] = id >= 0 && id < V ? static_cast<float>(x[id]) : 0.f;
        }
      }
    });
  });
  return out;
}

std::vector<at::Tensor> replay_forward(const at::Tensor& values, const at::Tensor& ids, const at::Tensor& target,
                                       const at::Tensor& temperature, int64_t wanted) {
  const ReplayArgs a = check_replay_args(values, ids, target, temperature);
  const bool with_entropy = (wanted & kEntropy) != 0;
  const auto f32 = values.options();
  at::Tensor logp = at::empty({a.N}, f32), lse = at::empty({a.N}, f32), row_max = at::empty({a.N}, f32);
  at::Tensor entropy = at::empty({with_entropy ? a.N : 0}, f32);
  at::Tensor log_mass = at::empty({a.N}, f32.dtype(at::kDouble));
  at::Tensor label_column = at::empty({a.N}, f32.dtype(at::kLong));
  int64_t* out_column = label_column.data_ptr<int64_t>();
  float *out_logp = logp.data_ptr<float>(), *out_lse = lse.data_ptr<float>(), *out_max = row_max.data_ptr<float>();
  float* out_h = with_entropy ? entropy.data_ptr<float>() : nullptr;
  double* out_mass = log_mass.data_ptr<double>();
  at::parallel_for(0, a.N, replay_grain(a.K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = a.x + n * a.K;
      const int64_t* id = a.ids + n * a.K;
      const int64_t tg = a.tgt[n];
      float m = -kInf;
      bool any = false, bad = false;
      for (int64_t k = 0; k < a.K; ++k) {
        if (id[k] < 0) continue;
        any = true;
        bad = bad || std::isnan(x[k]);
        m = std::max(m, x[k]);
      }
      const bool live = tg >= 0 && !bad && std::isfinite(m);
      out_max[n] = live ? m : 0.f;
      out_mass[n] = -kInf;
      out_column[n] = -1;
      if (!live) {  // the rules of reference.replay_forward's _settle
        const float value = tg == kSkip ? 0.f : tg == kOutOfRange ? kNaN : !any ? -kInf : kNaN;
        out_logp[n] = value;
        if (with_entropy) out_h[n] = tg == kSkip ? 0.f : tg == kOutOfRange ? kNaN : !any ? 0.f : kNaN;
        out_lse[n] = tg < 0 ? 0.f : (!any || m == -kInf) && !bad ? -kInf : kNaN;
        continue;
      }
      const double t = row_temperature(a.temp, n);
      int64_t mass = 0, weighted = 0;
      double d_label = 0.0;
      bool here = false;
      for (int64_t k = 0; k < a.K; ++k) {
        if (id[k] < 0) continue;
        const double d = (static_cast<double>(x[k]) - static_cast<double>(m)) / t;
        const double e = std::exp(d);
        mass += static_cast<int64_t>(e * kFixedUnit);
        if (with_entropy && e > 0) weighted += static_cast<int64_t>(e * d * kFixedUnit);
        if (id[k] == tg) {
          here = true;
          d_label = d;
          out_column[n] = k;
        }
      }
      const double lm = std::log(static_cast<double>(mass) / kFixedUnit);  // >= 0: the max adds 2^bits
      out_mass[n] = lm;
      out_logp[n] = here ? static_cast<float>(std::min(d_label - lm, 0.0)) : -kInf;
      out_lse[n] = static_cast<float>(static_cast<double>(m) / t + lm);
      if (with_entropy) out_h[n] = static_cast<float>(lm - static_cast<double>(weighted) / static_cast<double>(mass));
    }
  });
  return {logp, lse, entropy, row_max, log_mass, label_column};
}

at::Tensor replay_backward(const at::Tensor& values, const at::Tensor& ids, const at::Tensor& target,
                           const at::Tensor& temperature, const at::Tensor& row_max, const at::Tensor& log_mass,
                           const at::Tensor& c_label, const at::Tensor& c_p,
                           const std::optional<at::Tensor>& c_p_logp) {
  const ReplayArgs a = check_replay_args(values, ids, target, temperature);
  auto rows = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.numel() == a.N, "kltriton_cpp: ", name, " must have one entry per row");
    return t.to(dtype).contiguous();
  };
  const at::Tensor rm = rows(row_max, at::kFloat, "row_max"), lm = rows(log_mass, at::kDouble, "log_mass"),
                   cl = rows(c_label, at::kDouble, "c_label"), cp = rows(c_p, at::kDouble, "c_p");
  const at::Tensor cpl = c_p_logp.has_value() ? rows(*c_p_logp, at::kDouble, "c_p_logp") : at::Tensor();
  const float* pm = rm.data_ptr<float>();
  const double *plm = lm.data_ptr<double>(), *pcl = cl.data_ptr<double>(), *pcp = cp.data_ptr<double>(),
               *pcpl = cpl.defined() ? cpl.data_ptr<double>() : nullptr;
  at::Tensor grad = at::empty({a.N, a.K}, values.options());
  float* g = grad.data_ptr<float>();
  at::parallel_for(0, a.N, replay_grain(a.K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = a.x + n * a.K;
      const int64_t* id = a.ids + n * a.K;
      float* gn = g + n * a.K;
      const int64_t tg = a.tgt[n];
      if (tg < 0 || !std::isfinite(plm[n])) {
        std::fill(gn, gn + a.K, 0.f);
        continue;
      }
      const double t = row_temperature(a.temp, n), m = pm[n];
      for (int64_t k = 0; k < a.K; ++k) {
        if (id[k] < 0) {
          gn[k] = 0.f;
          continue;
        }
        const double logq = (static_cast<double>(x[k]) - m) / t - plm[n];
        const double p = std::exp(logq);
        double value = p > 0 ? -p * (pcp[n] + (pcpl != nullptr ? pcpl[n] * logq : 0.0)) : 0.0;
        if (id[k] == tg) value += pcl[n];
        gn[k] = static_cast<float>(value);
      }
    }
  });
  return grad;
}

at::Tensor replay_scatter(const at::Tensor& columns, const at::Tensor& ids, int64_t V, at::ScalarType dtype) {
  TORCH_CHECK(columns.dim() == 2 && columns.scalar_type() == at::kFloat && ids.sizes() == columns.sizes() &&
                  ids.scalar_type() == at::kLong,
              "kltriton_cpp: replay_scatter takes float32 columns and int64 ids, both [N, K]");
  TORCH_CHECK(V > 0, "kltriton_cpp: the vocabulary size must be > 0");
  const at::Tensor c = columns.contiguous(), i = ids.contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  at::Tensor grad = gradient_buffer(N, V, c.options().dtype(dtype));
  if (N == 0) return grad;
  const float* pc = c.data_ptr<float>();
  const int64_t* pi = i.data_ptr<int64_t>();
  with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* gbase = grad.data_ptr<T>();
    at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        T* row = gbase + n * V;
        zero_row(row, V);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t id = pi[n * K + k];
          if (id >= 0 && id < V) row[id] = static_cast<T>(pc[n * K + k]);
        }
      }
    });
  });
  return grad;
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("truncated_forward", &kltriton_cpp::truncated_forward);
  m.impl("truncated_backward", &kltriton_cpp::truncated_backward);
  m.impl("replay_support", &kltriton_cpp::replay_support);
  m.impl("replay_columns", &kltriton_cpp::replay_columns);
  m.impl("replay_forward", &kltriton_cpp::replay_forward);
  m.impl("replay_backward", &kltriton_cpp::replay_backward);
  m.impl("replay_scatter", &kltriton_cpp::replay_scatter);
}
