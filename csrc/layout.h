// The layout family's target and row-weights ops (layout.cpp), for the ops that make them and read them in one call.
#pragma once

#include <ATen/ATen.h>

namespace kltriton_cpp {

at::Tensor layout_target(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                         const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& temperature,
                         int64_t ignore_index, int64_t vocab, bool shift, const std::optional<at::Tensor>& flags);

std::vector<at::Tensor> layout_weights(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       const std::optional<at::Tensor>& temperature, int64_t ignore_index,
                                       int64_t vocab, bool shift, const std::optional<at::Tensor>& flags,
                                       int64_t aggregation, const std::optional<at::Tensor>& num_tokens,
                                       const std::optional<at::Tensor>& num_seqs_agg,
                                       const std::optional<at::Tensor>& horizon,
                                       const std::optional<at::Tensor>& advantages, bool per_sequence, double kl_coef,
                                       double entropy_coef);

}  // namespace kltriton_cpp
