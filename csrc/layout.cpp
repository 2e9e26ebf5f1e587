// The layout family's op on the CPU (kltriton/kernels/layout/): labels, mask, ignore_index, shift and packed
// segments into the one per-row target every kernel family reads, in one pass over the labels, and what is wrong
// with them recorded in the caller's flag vector (constants.py: BAD_* bits, FLAG_* slots) instead of a host read.
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include "common.h"

namespace kltriton_cpp {
namespace {

// A [R, C] strided view of an integer or bool tensor, read as int64.
template <typename I>
struct Grid2d {
  const I* data;
  int64_t cols, stride_r, stride_c;
  int64_t at(int64_t n) const { return static_cast<int64_t>(data[(n / cols) * stride_r + (n % cols) * stride_c]); }
};

template <typename I>
Grid2d<I> grid_of(const at::Tensor& t) {
  return Grid2d<I>{t.data_ptr<I>(), t.size(1), t.stride(0), t.stride(1)};
}

// The positions that end a packed segment: n + 1 is an offset of cu_seqlens[1:] (an empty segment marks the
// position before it, the end of the segment before; the last position ends the last segment). Offsets outside
// [1, N] (malformed cu_seqlens, flagged) mark nothing.
std::vector<char> segment_ends(const at::Tensor& cu, int64_t N) {
  std::vector<char> ends(N, 0);
  if (N > 0) ends[N - 1] = 1;
  const at::Tensor offsets = cu.to(at::kLong).contiguous();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t s = 1; s < offsets.numel(); ++s) {
    if (o[s] >= 1 && o[s] <= N) ends[o[s] - 1] = 1;
  }
  return ends;
}

void check_cu_seqlens(const at::Tensor& cu, int64_t N, int64_t* flags) {
  const at::Tensor offsets = cu.to(at::kLong).contiguous();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t count = offsets.numel();
  if (o[0] != 0 || o[count - 1] != N) {
    flags[KLTRITON_FLAG_BITS] |= KLTRITON_BAD_CU_SEQLENS_ENDS;
    flags[KLTRITON_FLAG_CU_FIRST] = o[0];
    flags[KLTRITON_FLAG_CU_LAST] = o[count - 1];
  }
  for (int64_t s = 1; s < count; ++s) {
    if (o[s] < o[s - 1]) {
      flags[KLTRITON_FLAG_BITS] |= KLTRITON_BAD_CU_SEQLENS_ORDER;
      break;
    }
  }
}

void check_temperature(const at::Tensor& temperature, int64_t* flags) {
  const at::Tensor t = temperature.to(at::kDouble).contiguous();
  const double* v = t.data_ptr<double>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!(v[i] > 0.0 && std::isfinite(v[i]))) {
      flags[KLTRITON_FLAG_BITS] |= KLTRITON_BAD_TEMPERATURE;
      return;
    }
  }
}

template <typename L, typename M>
void fill_target(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d, const char* ends, bool shift,
                 int64_t ignore_index, int64_t vocab, int64_t* target, int64_t N, int64_t* flags) {
  const Grid2d<L> labels = grid_of<L>(labels2d);
  const Grid2d<M> mask = mask2d.has_value() ? grid_of<M>(*mask2d) : Grid2d<M>{nullptr, 1, 0, 0};
  const int64_t cols = labels.cols;
  bool bad = false;
  int64_t bad_label = 0;
  for (int64_t n = 0; n < N; ++n) {
    // shift: position n is scored on the label (and mask) of n + 1 of the same sequence
    const bool last = shift && (ends != nullptr ? ends[n] != 0 : n % cols == cols - 1);
    if (last) {
      target[n] = kSkip;
      continue;
    }
    const int64_t src = shift ? n + 1 : n;
    const int64_t label = labels.at(src);
    const bool scored = label != ignore_index && (mask.data == nullptr || mask.at(src) != 0);
    const bool in_range = label >= 0 && label < vocab;
    target[n] = !scored ? kSkip : (in_range ? label : kOutOfRange);
    if (scored && !in_range && !bad) {
      bad = true;
      bad_label = label;
    }
  }
  if (bad && flags != nullptr) {
    flags[KLTRITON_FLAG_BITS] |= KLTRITON_BAD_LABEL;
    flags[KLTRITON_FLAG_LABEL] = bad_label;
  }
}

}  // namespace

at::Tensor layout_target(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                         const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& temperature,
                         int64_t ignore_index, int64_t vocab, bool shift, const std::optional<at::Tensor>& flags) {
  TORCH_CHECK(labels2d.dim() == 2, "kltriton_cpp: labels must be a [R, C] view");
  TORCH_CHECK(!mask2d.has_value() || mask2d->sizes() == labels2d.sizes(), "kltriton_cpp: mask must match labels");
  TORCH_CHECK(!flags.has_value() || (flags->scalar_type() == at::kLong && flags->is_contiguous() &&
                                     flags->numel() == KLTRITON_NUM_FLAGS && flags->device().is_cpu()),
              "kltriton_cpp: flags must be a contiguous CPU int64 vector of the FLAG_SLOTS");
  const int64_t N = labels2d.numel();
  at::Tensor target = at::empty({N}, labels2d.options().dtype(at::kLong));
  int64_t* f = flags.has_value() ? flags->data_ptr<int64_t>() : nullptr;
  if (f != nullptr && temperature.has_value()) check_temperature(*temperature, f);
  if (f != nullptr && cu_seqlens.has_value()) check_cu_seqlens(*cu_seqlens, N, f);
  if (N == 0) return target;
  const std::vector<char> ends = shift && cu_seqlens.has_value() ? segment_ends(*cu_seqlens, N) : std::vector<char>();
  const char* end_ptr = ends.empty() ? nullptr : ends.data();
  // every integer dtype (the unsigned ones too: AT_INTEGRAL_TYPES_V2), and bool for the mask
  AT_DISPATCH_V2(labels2d.scalar_type(), "layout_target", AT_WRAP([&] {
    using L = scalar_t;
    if (!mask2d.has_value()) {
      fill_target<L, bool>(labels2d, mask2d, end_ptr, shift, ignore_index, vocab, target.data_ptr<int64_t>(), N, f);
      return;
    }
    AT_DISPATCH_V2(mask2d->scalar_type(), "layout_target_mask", AT_WRAP([&] {
      fill_target<L, scalar_t>(labels2d, mask2d, end_ptr, shift, ignore_index, vocab, target.data_ptr<int64_t>(), N,
                               f);
    }), AT_EXPAND(AT_INTEGRAL_TYPES_V2), at::kBool);
  }), AT_EXPAND(AT_INTEGRAL_TYPES_V2));
  return target;
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("layout_target", &kltriton_cpp::layout_target);
}
