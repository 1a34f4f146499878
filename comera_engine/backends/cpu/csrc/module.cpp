// The Python module of the native TT-linear ops (built by comera_engine/backends/cpu/build.py).
#include <torch/extension.h>

#include "tt_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("sweep_forward", &comera::sweep_forward, "TT-linear sweep forward (ops)");
  mod.def("sweep_backward", &comera::sweep_backward, "TT-linear sweep backward (ops)");
  mod.def("halves_prepare", &comera::halves_prepare,
          "TT-linear halves: gates, merges, padded L and R (ops)");
  mod.def("halves_core_grads", &comera::halves_core_grads,
          "TT-linear halves: core and gate gradients from dL and dR (ops)");
  mod.def("halves_batch_forward", &comera::halves_batch_forward,
          "TT-linear halves: the batch GEMMs of the forward, row-blocked (ops)");
  mod.def("halves_batch_blas", &comera::halves_batch_blas,
          "TT-linear halves: whether the blocked step calls BLAS directly (-1 asks, 0/1 sets)");
  mod.def("halves_batch_backward", &comera::halves_batch_backward,
          "TT-linear halves: the batch GEMMs of the backward, row-blocked (ops)");
  mod.def("ttm_matrix", &comera::ttm_matrix,
          "TT matrix: W (N, M) from gated cores, one autograd node (tensor.tt)");
  mod.def("clip_grad_norm", &comera::clip_grad_norm,
          "gradients: total 2-norm, scaled in place to max_norm (train.step)");
  mod.def("adamw_step", &comera::adamw_step,
          "AdamW: every parameter group's update in one call (ops.adamw)");
}
