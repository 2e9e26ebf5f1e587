// The invariant family's ops on the CPU (kltriton/kernels/invariant/cpp.py): the row kernels of invariant.h, rows
// in parallel. invariant_forward reads each row from memory once for both passes (the row stays in cache between
// its maximum and its sums).
#include <torch/library.h>

#include "invariant.h"
#include "row_forward.h"  // kEntropy

#include <type_traits>

namespace kltriton_cpp {
namespace {

// The optional floor as a pointer to N floats (nullptr: none).
const float* floor_of(const std::optional<at::Tensor>& floor, int64_t N) {
  if (!floor.has_value()) return nullptr;
  TORCH_CHECK(floor->scalar_type() == at::kFloat && floor->is_contiguous() && floor->numel() == N,
              "kltriton_cpp: floor must be a contiguous float32 tensor with one entry per row");
  return floor->data_ptr<float>();
}

// fn(tag, floor_tag, n) for every row n < N, rows in parallel, with T = typename decltype(tag)::type the logits' C++
// type and FLOOR = decltype(floor_tag)::value whether a floor is given.
template <typename F>
void for_each_row(const at::Tensor& logits3d, const float* floor, int64_t N, int64_t V, F&& fn) {
  with_dtype(logits3d.scalar_type(), [&](auto tag) {
    const auto rows = [&](auto floor_tag) {
      at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) fn(tag, floor_tag, n);
      });
    };
    if (floor != nullptr) {
      rows(std::true_type{});
    } else {
      rows(std::false_type{});
    }
  });
}

// sums (1 or 2 rows of N) of row n given its maximum m, or 0 where the row is not read or m is not finite.
template <typename T, bool FLOOR>
void row_sums(const T* x, int64_t V, int64_t n, float m, bool read, bool entropy, const Temperatures& temp,
              const float* floor, int64_t* mass, int64_t* weighted) {
  mass[n] = 0;
  if (entropy) weighted[n] = 0;
  if (!read || !std::isfinite(m)) return;
  const float c = invariant_scale(temp, n), f = FLOOR ? floor[n] : -kInf;
  if (entropy) {
    invariant_row_sums<T, FLOOR, true>(x, V, m, c, f, mass + n, weighted + n);
  } else {
    invariant_row_sums<T, FLOOR, false>(x, V, m, c, f, mass + n, nullptr);
  }
}

at::Tensor new_sums(const at::Tensor& logits3d, int64_t N, int64_t wanted) {
  return at::empty({(wanted & kEntropy) ? 2 : 1, N}, logits3d.options().dtype(at::kLong));
}

}  // namespace

at::Tensor invariant_maxima(const at::Tensor& logits3d, const at::Tensor& target, const std::optional<at::Tensor>& floor) {
  check_rows3d(logits3d, "logits");
  const int64_t N = logits3d.size(0) * logits3d.size(1), V = logits3d.size(2);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == N,
              "kltriton_cpp: target must be a contiguous int64 tensor with one entry per row");
  const float* pf = floor_of(floor, N);
  at::Tensor out = at::empty({N}, logits3d.options().dtype(at::kFloat));
  float* po = out.data_ptr<float>();
  const int64_t* tgt = target.data_ptr<int64_t>();
  const Rows3d X(logits3d);
  for_each_row(logits3d, pf, N, V, [&](auto tag, auto has_floor, int64_t n) {
    using T = typename decltype(tag)::type;
    constexpr bool FLOOR = decltype(has_floor)::value;
    po[n] = tgt[n] >= 0 ? invariant_row_max<T, FLOOR>(X.row<T>(n), V, FLOOR ? pf[n] : -kInf) : -kInf;
  });
  return out;
}

namespace {

// The rows' fixed-point sums ([1 or 2, N] int64: mass, and the entropy's weighted sum if `wanted` asks) around the
// row maxima that `maximum(x, n, read, has_floor)` gives for row n (x its logits, read: the row is scored).
template <typename Maximum>
at::Tensor sums_around(const at::Tensor& logits3d, const at::Tensor& target, const at::Tensor& temperature,
                       const float* pf, int64_t N, int64_t V, int64_t wanted, Maximum maximum) {
  at::Tensor out = new_sums(logits3d, N, wanted);
  const bool entropy = (wanted & kEntropy) != 0;
  int64_t* mass = out.data_ptr<int64_t>();
  int64_t* weighted = entropy ? mass + N : nullptr;
  const int64_t* tgt = target.data_ptr<int64_t>();
  const Temperatures temp{temperature.data_ptr<double>(), temperature.numel() == N && N > 1};
  const Rows3d X(logits3d);
  for_each_row(logits3d, pf, N, V, [&](auto tag, auto has_floor, int64_t n) {
    using T = typename decltype(tag)::type;
    constexpr bool FLOOR = decltype(has_floor)::value;
    const T* x = X.row<T>(n);
    const bool read = tgt[n] >= 0;
    row_sums<T, FLOOR>(x, V, n, maximum(x, n, read, has_floor), read, entropy, temp, pf, mass, weighted);
  });
  return out;
}

}  // namespace

at::Tensor invariant_sums(const at::Tensor& logits3d, const at::Tensor& target, const at::Tensor& temperature,
                          const at::Tensor& row_max, const std::optional<at::Tensor>& floor, int64_t wanted) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  TORCH_CHECK(row_max.scalar_type() == at::kFloat && row_max.is_contiguous() && row_max.numel() == N,
              "kltriton_cpp: row_max must be a contiguous float32 tensor with one entry per row");
  const float* pm = row_max.data_ptr<float>();
  return sums_around(logits3d, target, temperature, floor_of(floor, N), N, V, wanted,
                     [&](const auto*, int64_t n, bool, auto) { return pm[n]; });
}

std::vector<at::Tensor> invariant_forward(const at::Tensor& logits3d, const at::Tensor& target,
                                          const at::Tensor& temperature, const std::optional<at::Tensor>& floor,
                                          int64_t wanted) {
  int64_t N, V;
  std::tie(N, V) = check_stream_args(logits3d, target, temperature);
  const float* pf = floor_of(floor, N);
  at::Tensor row_max = at::empty({N}, logits3d.options().dtype(at::kFloat));
  float* pm = row_max.data_ptr<float>();
  at::Tensor out = sums_around(logits3d, target, temperature, pf, N, V, wanted,
                               [&](const auto* x, int64_t n, bool read, auto has_floor) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    constexpr bool FLOOR = decltype(has_floor)::value;
    pm[n] = read ? invariant_row_max<T, FLOOR>(x, V, FLOOR ? pf[n] : -kInf) : -kInf;
    return pm[n];
  });
  return {row_max, out};
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("invariant_maxima", &kltriton_cpp::invariant_maxima);
  m.impl("invariant_sums", &kltriton_cpp::invariant_sums);
  m.impl("invariant_forward", &kltriton_cpp::invariant_forward);
}
