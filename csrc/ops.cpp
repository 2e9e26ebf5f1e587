// Defines the kltriton C++ CPU backend's torch ops (namespace kltriton_cpp; the namespace
// "kltriton" belongs to the Python custom ops), reached from Python as torch.ops.kltriton_cpp.<op>
// by each family's cpp.py once kltriton/kernels/cpp_library.py has loaded the library. Each op's
// CPU kernel is registered where it is defined (TORCH_LIBRARY_IMPL at the end of its .cpp).
#include <torch/library.h>

#include "common.h"

#define KLT_STR2(x) #x
#define KLT_STR(x) KLT_STR2(x)

// Read (as bytes, before loading) by kltriton/kernels/cpp_library.py to check that an
// ahead-of-time built library only uses instructions this machine has.
extern "C" __attribute__((visibility("default"), used)) const char kltriton_cpp_build_tag[] =
    "KLTRITON_CPP_BUILD_TAG cap=" KLT_STR(CPU_CAPABILITY) ";";

namespace kltriton_cpp {

std::string build_info() {
  return std::string("cap=") + KLT_STR(CPU_CAPABILITY) + ";vec=" + std::to_string(kW);
}

}  // namespace kltriton_cpp

TORCH_LIBRARY(kltriton_cpp, m) {
  m.def("layout_scored_rows(Tensor rows, Tensor target, Tensor(a!) out) -> ()");
  m.def(
      "layout_target_rows(Tensor labels2d, Tensor? mask2d, Tensor? cu_seqlens, Tensor? temperature, int ignore_index, "
      "int vocab, bool shift, Tensor(a!)? flags, Tensor rows, Tensor(b!) out) -> Tensor");
  m.def(
      "layout_weights(Tensor labels2d, Tensor? mask2d, Tensor? cu_seqlens, Tensor? temperature, int ignore_index, "
      "int vocab, bool shift, Tensor(a!)? flags, int aggregation, Tensor? num_tokens, Tensor? num_seqs_agg, "
      "Tensor? horizon, Tensor? advantages, bool per_sequence, float kl_coef, float entropy_coef) -> Tensor[]");
  m.def(
      "loss_terms(Tensor logp, Tensor? ref_logp, bool ref_given, Tensor? full_kl, Tensor? entropy, Tensor target, "
      "Tensor? old_logp, Tensor advantages, Tensor w_pg, Tensor w_kl, Tensor w_ent, Tensor w_agg, "
      "Tensor hyperparameters, str loss_type, str estimator, bool straight_through) -> Tensor[]");
  m.def(
      "kl_reward(Tensor logp, Tensor? full_kl, Tensor ref_logp, bool ref_given, Tensor target, int num_seqs, "
      "int seq_len, Tensor? cu_seqlens, str estimator, bool straight_through, float kl_clamp, Tensor? coef, "
      "Tensor? rewards, Tensor? scores, float score_clip) -> Tensor[]");
  m.def(
      "kl_reward_backward(Tensor logp, Tensor? full_kl, Tensor ref_logp, bool ref_given, Tensor target, "
      "int num_seqs, int seq_len, Tensor? cu_seqlens, str estimator, bool straight_through, float kl_clamp, "
      "Tensor? coef, Tensor? count, Tensor? g_kl, Tensor? g_reward, Tensor? g_kl_per_seq) -> Tensor[]");
  m.def(
      "layout_target(Tensor labels2d, Tensor? mask2d, Tensor? cu_seqlens, Tensor? temperature, int ignore_index, "
      "int vocab, bool shift, Tensor(a!)? flags) -> Tensor");
  m.def("stream_forward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, int wanted) -> Tensor[]");
  m.def(
      "stream_forward_labels(Tensor logits3d, Tensor? ref3d, Tensor labels2d, Tensor? mask2d, Tensor? cu_seqlens, "
      "Tensor? checked_temperature, int ignore_index, bool shift, Tensor(a!)? flags, Tensor temperature, int wanted) "
      "-> Tensor[]");
  m.def(
      "stream_backward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, Tensor lse, "
      "Tensor? ref_lse, Tensor?[] basis) -> Tensor");
  m.def(
      "stream_backward_upstream(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, Tensor lse, "
      "Tensor? ref_lse, Tensor?[] upstream, Tensor(a!)? out) -> Tensor");
  m.def(
      "loss_forward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, Tensor? old_logp, "
      "Tensor advantages, Tensor w_pg, Tensor w_kl, Tensor w_ent, Tensor? ref_logp, Tensor hyperparameters, "
      "str loss_type, str estimator, bool straight_through, bool entropy_grad, bool with_grad, bool with_entropy) "
      "-> Tensor[]");
  m.def(
      "loss_forward_labels(Tensor logits3d, Tensor? ref3d, Tensor labels2d, Tensor? mask2d, Tensor? cu_seqlens, "
      "Tensor? checked_temperature, int ignore_index, bool shift, Tensor(a!)? flags, int aggregation, "
      "Tensor? num_tokens, Tensor? num_seqs_agg, Tensor? horizon, Tensor? advantages, bool per_sequence, "
      "float kl_coef, float entropy_coef, Tensor temperature, Tensor? old_logp, Tensor? ref_logp, "
      "Tensor hyperparameters, str loss_type, str estimator, bool straight_through, bool entropy_grad, "
      "bool with_grad, bool with_entropy) -> Tensor[]");
  m.def(
      "loss_coefficients(Tensor logp, Tensor ref_logp, Tensor? old_logp, Tensor advantages, Tensor w_pg, "
      "Tensor w_kl, Tensor? full_kl, Tensor hyperparameters, str loss_type, str estimator, bool straight_through) "
      "-> Tensor");
  m.def(
      "loss_accumulate_(Tensor(a!) grad, Tensor logits3d, Tensor target, Tensor temperature, Tensor lse, "
      "Tensor c_label, Tensor c_p, Tensor? c_p_logp) -> ()");
  m.def("loss_scale_(Tensor(a!) grad, Tensor upstream) -> ()");
  m.def(
      "truncated_forward(Tensor logits3d, Tensor target, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, Tensor? floor, int wanted) -> Tensor[]");
  m.def(
      "truncated_backward(Tensor logits3d, Tensor target, Tensor temperature, Tensor floor, Tensor lse, "
      "Tensor c_label, Tensor c_p, Tensor? c_p_logp) -> Tensor");
  m.def("replay_support(Tensor ids) -> Tensor");
  m.def("replay_columns(Tensor logits3d, Tensor ids) -> Tensor");
  m.def("replay_forward(Tensor values, Tensor ids, Tensor target, Tensor temperature, int wanted) -> Tensor[]");
  m.def(
      "replay_backward(Tensor values, Tensor ids, Tensor target, Tensor temperature, Tensor row_max, "
      "Tensor log_mass, Tensor c_label, Tensor c_p, Tensor? c_p_logp) -> Tensor");
  m.def("replay_scatter(Tensor columns, Tensor ids, int vocab, ScalarType dtype) -> Tensor");
  m.def(
      "jsd_forward(Tensor logits3d, Tensor ref3d, Tensor target, Tensor temperature, Tensor lse, Tensor ref_lse, "
      "Tensor beta) -> Tensor[]");
  m.def(
      "jsd_backward(Tensor logits3d, Tensor ref3d, Tensor target, Tensor temperature, Tensor lse, Tensor ref_lse, "
      "Tensor beta, Tensor kl_student, Tensor coef) -> Tensor");
  m.def("invariant_maxima(Tensor logits3d, Tensor target, Tensor? floor) -> Tensor");
  m.def(
      "invariant_sums(Tensor logits3d, Tensor target, Tensor temperature, Tensor row_max, Tensor? floor, "
      "int wanted) -> Tensor");
  m.def(
      "invariant_forward(Tensor logits3d, Tensor target, Tensor temperature, Tensor? floor, int wanted) -> "
      "Tensor[]");
  m.def("build_info() -> str", &kltriton_cpp::build_info);
  m.def("empty_gradient_cache() -> int", &kltriton_cpp::empty_gradient_cache);
}

// The ops are not differentiable themselves (the Python layer wires their backward): let the
// autograd key fall through so outputs are plain tensors even when logits require grad.
TORCH_LIBRARY_IMPL(kltriton_cpp, Autograd, m) {
  m.impl("layout_scored_rows", torch::CppFunction::makeFallthrough());
  m.impl("layout_target_rows", torch::CppFunction::makeFallthrough());
  m.impl("layout_weights", torch::CppFunction::makeFallthrough());
  m.impl("loss_terms", torch::CppFunction::makeFallthrough());
  m.impl("kl_reward", torch::CppFunction::makeFallthrough());
  m.impl("kl_reward_backward", torch::CppFunction::makeFallthrough());
  m.impl("layout_target", torch::CppFunction::makeFallthrough());
  m.impl("stream_forward", torch::CppFunction::makeFallthrough());
  m.impl("stream_forward_labels", torch::CppFunction::makeFallthrough());
  m.impl("stream_backward", torch::CppFunction::makeFallthrough());
  m.impl("stream_backward_upstream", torch::CppFunction::makeFallthrough());
  m.impl("loss_forward", torch::CppFunction::makeFallthrough());
  m.impl("loss_forward_labels", torch::CppFunction::makeFallthrough());
  m.impl("loss_coefficients", torch::CppFunction::makeFallthrough());
  m.impl("loss_accumulate_", torch::CppFunction::makeFallthrough());
  m.impl("loss_scale_", torch::CppFunction::makeFallthrough());
  m.impl("truncated_forward", torch::CppFunction::makeFallthrough());
  m.impl("truncated_backward", torch::CppFunction::makeFallthrough());
  m.impl("replay_support", torch::CppFunction::makeFallthrough());
  m.impl("replay_columns", torch::CppFunction::makeFallthrough());
  m.impl("replay_forward", torch::CppFunction::makeFallthrough());
  m.impl("replay_backward", torch::CppFunction::makeFallthrough());
  m.impl("replay_scatter", torch::CppFunction::makeFallthrough());
  m.impl("jsd_forward", torch::CppFunction::makeFallthrough());
  m.impl("jsd_backward", torch::CppFunction::makeFallthrough());
  m.impl("invariant_maxima", torch::CppFunction::makeFallthrough());
  m.impl("invariant_sums", torch::CppFunction::makeFallthrough());
  m.impl("invariant_forward", torch::CppFunction::makeFallthrough());
}
