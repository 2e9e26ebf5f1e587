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

enum Aggregation : int { kTokenMean, kTokenSum, kSeqMeanTokenSum, kSeqMeanTokenMean, kSeqMeanTokenSumNorm };

double scalar_of(const std::optional<at::Tensor>& t) {
  return t->to(at::kDouble).item<double>();  // a CPU tensor: host memory, no device sync
}

// [5, N] float32 from the targets: each row's advantage (a per-sequence one broadcast; 0 without), its aggregation
// weight (verl's agg_loss(x) = sum_n w_n x_n over the positions with target != SKIP, the sequences being the rows of
// [R, C] or the packed segments), and the weights of a loss's policy, KL and entropy terms (that weight times 1,
// kl_coef and -entropy_coef).
at::Tensor row_weights(const int64_t* tgt, int64_t N, int64_t num_seqs, int64_t seq_len, const int64_t* cu,
                       int64_t aggregation, const std::optional<at::Tensor>& num_tokens,
                       const std::optional<at::Tensor>& num_seqs_agg, const std::optional<at::Tensor>& horizon,
                       const std::optional<at::Tensor>& advantages, bool per_seq, double kl_coef, double entropy_coef,
                       const at::TensorOptions& options) {
  at::Tensor adv_keep;
  const float* adv = nullptr;
  if (advantages.has_value()) {
    TORCH_CHECK(advantages->numel() == (per_seq ? num_seqs : N), "kltriton_cpp: advantages has ",
                advantages->numel(), " entries, expected ", per_seq ? num_seqs : N);
    adv_keep = advantages->to(at::kFloat).contiguous();
    adv = adv_keep.data_ptr<float>();
  }
  // each position's sequence, and the positions with target != SKIP counted per sequence
  std::vector<int64_t> seq(N, 0);
  std::vector<double> count(std::max<int64_t>(num_seqs, 1), 0.0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t start = cu ? cu[s] : s * seq_len, end = cu ? cu[s + 1] : (s + 1) * seq_len;
    start = std::min(std::max<int64_t>(start, 0), N);
    end = std::min(std::max(end, start), N);
    for (int64_t n = start; n < end; ++n) {
      seq[n] = s;
      count[s] += tgt[n] != kSkip ? 1.0 : 0.0;
    }
  }
  double total = 0.0, nonempty = 0.0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    total += count[s];
    nonempty += count[s] > 0 ? 1.0 : 0.0;
  }
  // The given denominators are read once, each only by the aggregation that divides by it (a read per row was a
  // tensor op per row: 10x the whole kernel).
  TORCH_CHECK(aggregation != kSeqMeanTokenSumNorm || horizon.has_value(),
              "kltriton_cpp: seq-mean-token-sum-norm needs the horizon");
  const double sequences = num_seqs_agg.has_value() ? scalar_of(num_seqs_agg) : std::max(nonempty, 1.0);
  const double tokens =
      aggregation == kTokenMean && num_tokens.has_value() ? scalar_of(num_tokens) : std::max(total, 1.0);
  const double norm = aggregation == kSeqMeanTokenSumNorm ? scalar_of(horizon) : 1.0;
  at::Tensor out = at::empty({5, N}, options.dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const double valid = tgt[n] != kSkip ? 1.0 : 0.0;
    double w = valid;
    switch (aggregation) {
      case kTokenSum: break;
      case kTokenMean: w = valid / tokens; break;
      case kSeqMeanTokenSum: w = valid / sequences; break;
      case kSeqMeanTokenMean: w = valid / std::max(count[seq[n]], 1.0) / sequences; break;
      case kSeqMeanTokenSumNorm: w = valid / sequences / norm; break;
      default: TORCH_CHECK(false, "kltriton_cpp: unknown aggregation ", aggregation);
    }
    const float wf = static_cast<float>(w);
    o[n] = adv == nullptr ? 0.f : adv[per_seq ? seq[n] : n];
    o[N + n] = wf;
    o[2 * N + n] = wf;
    o[3 * N + n] = static_cast<float>(static_cast<double>(wf) * kl_coef);
    o[4 * N + n] = static_cast<float>(static_cast<double>(wf) * -entropy_coef);
  }
  return out;
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

// layout_target and, from its targets, row_weights: the label side of a loss in one op.
std::vector<at::Tensor> layout_weights(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       const std::optional<at::Tensor>& temperature, int64_t ignore_index,
                                       int64_t vocab, bool shift, const std::optional<at::Tensor>& flags,
                                       int64_t aggregation, const std::optional<at::Tensor>& num_tokens,
                                       const std::optional<at::Tensor>& num_seqs_agg,
                                       const std::optional<at::Tensor>& horizon,
                                       const std::optional<at::Tensor>& advantages, bool per_sequence, double kl_coef,
                                       double entropy_coef) {
  at::Tensor target = layout_target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags);
  const int64_t N = target.numel();
  at::Tensor keep_cu;
  const int64_t* cu = nullptr;
  int64_t num_seqs = labels2d.size(0);
  if (cu_seqlens.has_value()) {
    keep_cu = cu_seqlens->to(at::kLong).contiguous();
    cu = keep_cu.data_ptr<int64_t>();
    num_seqs = keep_cu.numel() - 1;
  }
  return {target, row_weights(target.data_ptr<int64_t>(), N, num_seqs, labels2d.size(1), cu, aggregation, num_tokens,
                              num_seqs_agg, horizon, advantages, per_sequence, kl_coef, entropy_coef,
                              labels2d.options())};
}

// out[n] = rows[n] where n < N and target[n] >= 0, else 0 (in out's dtype): the scored rows of a projection in a
// fixed-shape tile, the others zero (never read: a non-finite hidden state there changes nothing).
void layout_scored_rows(const at::Tensor& rows, const at::Tensor& target, at::Tensor& out) {
  const int64_t N = target.numel();
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == N && out.dim() == 2 && out.size(0) >= N &&
                  out.size(1) == rows.size(1) && out.is_contiguous() && target.scalar_type() == at::kLong &&
                  target.is_contiguous(),
              "kltriton_cpp: scored_rows needs rows [N, H], int64 target [N] and a contiguous out [>= N, H]");
  const int64_t* tgt = target.data_ptr<int64_t>();
  const int64_t H = rows.size(1), rs0 = rows.stride(0), rs1 = rows.stride(1);
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "scored_rows_out", [&] {
    using O = scalar_t;
    O* o = out.data_ptr<O>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "scored_rows", [&] {
      const scalar_t* r = rows.data_ptr<scalar_t>();
      for (int64_t n = 0; n < out.size(0); ++n) {
        for (int64_t h = 0; h < H; ++h) {
          o[n * H + h] = n < N && tgt[n] >= 0 ? static_cast<O>(r[n * rs0 + h * rs1]) : O(0);
        }
      }
    });
  });
}

// layout_target and, from its targets, layout_scored_rows: the label side of a one-tile projection and its GEMM operand
// in one op (each call through torch.ops costs the host a few microseconds, more than both kernels at small N).
at::Tensor layout_target_rows(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                              const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& temperature,
                              int64_t ignore_index, int64_t vocab, bool shift, const std::optional<at::Tensor>& flags,
                              const at::Tensor& rows, at::Tensor& out) {
  at::Tensor target = layout_target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags);
  layout_scored_rows(rows, target, out);
  return target;
}

}  // namespace kltriton_cpp

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("layout_target_rows", &kltriton_cpp::layout_target_rows);
  m.impl("layout_scored_rows", &kltriton_cpp::layout_scored_rows);
  m.impl("layout_target", &kltriton_cpp::layout_target);
  m.impl("layout_weights", &kltriton_cpp::layout_weights);
}
