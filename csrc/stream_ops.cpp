// Registers the kltriton C++ CPU backend as torch ops (namespace kltriton_cpp; the namespace
// "kltriton" belongs to the Python custom ops). Reached from Python as
// torch.ops.kltriton_cpp.stream_forward / stream_backward (see kltriton/kernels/cpp_stream.py).
#include <torch/library.h>

#include "stream_common.h"

#define KLT_STR2(x) #x
#define KLT_STR(x) KLT_STR2(x)

// Read (as bytes, before loading) by kltriton.kernels.cpp_stream to check that an
// ahead-of-time built library only uses instructions this machine has.
extern "C" __attribute__((visibility("default"), used)) const char kltriton_cpp_build_tag[] =
    "KLTRITON_CPP_BUILD_TAG cap=" KLT_STR(CPU_CAPABILITY) ";";

namespace kltriton_cpp {

std::string build_info() {
  return std::string("cap=") + KLT_STR(CPU_CAPABILITY) + ";vec=" + std::to_string(kW);
}

}  // namespace kltriton_cpp

TORCH_LIBRARY(kltriton_cpp, m) {
  m.def(
      "stream_forward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, "
      "bool with_entropy, bool with_full_kl) -> Tensor[]");
  m.def(
      "stream_backward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, "
      "Tensor lse, Tensor? ref_lse, Tensor g_logp, Tensor? g_entropy, Tensor? entropy, "
      "Tensor? g_full_kl, Tensor? full_kl) -> Tensor");
  m.def(
      "loss_forward(Tensor logits3d, Tensor? ref3d, Tensor target, Tensor temperature, Tensor? old_logp, "
      "Tensor advantages, Tensor w_pg, Tensor w_kl, Tensor w_ent, Tensor? ref_logp, Tensor bounds, "
      "int loss_type, int estimator, bool straight_through, bool entropy_grad, bool with_grad) -> Tensor[]");
  m.def("loss_scale_(Tensor(a!) grad, Tensor upstream) -> ()");
  m.def("build_info() -> str", &kltriton_cpp::build_info);
}

TORCH_LIBRARY_IMPL(kltriton_cpp, CPU, m) {
  m.impl("stream_forward", &kltriton_cpp::stream_forward);
  m.impl("stream_backward", &kltriton_cpp::stream_backward);
  m.impl("loss_forward", &kltriton_cpp::loss_forward);
  m.impl("loss_scale_", &kltriton_cpp::loss_scale_);
}

// The ops are not differentiable themselves (the Python layer wires their backward): let the
// autograd key fall through so outputs are plain tensors even when logits require grad.
TORCH_LIBRARY_IMPL(kltriton_cpp, Autograd, m) {
  m.impl("stream_forward", torch::CppFunction::makeFallthrough());
  m.impl("stream_backward", torch::CppFunction::makeFallthrough());
  m.impl("loss_forward", torch::CppFunction::makeFallthrough());
  m.impl("loss_scale_", torch::CppFunction::makeFallthrough());
}
