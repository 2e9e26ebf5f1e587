// The layout family's target op (layout.cpp), for the ops that make the target and read it in one call.
#pragma once

#include <ATen/ATen.h>

namespace kltriton_cpp {

at::Tensor layout_target(const at::Tensor& labels2d, const std::optional<at::Tensor>& mask2d,
                         const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& temperature,
                         int64_t ignore_index, int64_t vocab, bool shift, const std::optional<at::Tensor>& flags);

}  // namespace kltriton_cpp
