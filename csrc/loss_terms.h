// The loss family's [N] op (loss_terms.cpp), for the op that runs the fused loss and its terms in one call.
#pragma once

#include <ATen/ATen.h>

namespace kltriton_cpp {

std::vector<at::Tensor> loss_terms(const at::Tensor& logp, const std::optional<at::Tensor>& ref_logp, bool ref_given,
                                   const std::optional<at::Tensor>& full_kl, const std::optional<at::Tensor>& entropy,
                                   const at::Tensor& target, const std::optional<at::Tensor>& old_logp,
                                   const at::Tensor& advantages, const at::Tensor& w_pg, const at::Tensor& w_kl,
                                   const at::Tensor& w_ent, const at::Tensor& w_agg,
                                   const at::Tensor& hyperparameters, const std::string& loss_type,
                                   const std::string& estimator, bool straight_through);

}  // namespace kltriton_cpp
