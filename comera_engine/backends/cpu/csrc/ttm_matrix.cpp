// The matrix of a gated TT-matrix as one autograd node (comera_engine/tensor/tt.py,
// TTMCores.to_matrix: the PyTorch reference), and the gradient clipping of a training step
// over all its gradients in one pass (torch.nn.utils.clip_grad_norm_: the reference).
//
// TT matrix: cores G_k (r_{k-1}, n_k, m_k, r_k), k < K, and gates g_b for the K-1 internal
// bonds, bond b absorbed on the right of core b: E_b = G_b · diag(v_b) with
// v_b = g_b where alive_b and |g_b| > tau, else 0. Left to right, A_0 = E_0 as
// (n_0 m_0, r_1) and A_k = (A_{k-1} · E_k as (r_k, n_k m_k r_{k+1})) as (·, r_{k+1}); the
// last A (∏ n_k m_k, 1) holds the modes (n_0, m_0, n_1, m_1, …), permuted to
// (n_0..n_{K-1}, m_0..m_{K-1}) and returned as W (∏ n_k, ∏ m_k). The reference runs ~15
// small ops a layer each way (three a gate, the products, reshapes and the permutation),
// each an autograd node; at a small model's sizes those per-op costs exceed the
// arithmetic. Backward walks the chain back: dE_k = A_{k-1}ᵀ·dA_k, dA_{k-1} = dA_k·E_kᵀ,
// then dG_b = dE_b · diag(v_b) and dg_b = m_b ⊙ Σ_rows dE_b ⊙ G_b.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <vector>

#include "tt_common.h"

namespace comera {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct TTMMatrix : public torch::autograd::Function<TTMMatrix> {
  static variable_list forward(AutogradContext* ctx, at::TensorList cores_in,
                               at::TensorList gates_in, const std::vector<Tensor>* alive,
                               double tau) {
    const int64_t K = static_cast<int64_t>(cores_in.size());
    TORCH_CHECK(K >= 1, "ttm_matrix: no cores");
    TORCH_CHECK(gates_in.empty() || static_cast<int64_t>(gates_in.size()) == K - 1,
                "ttm_matrix: ", gates_in.size(), " gates for ", K, " cores");
    std::vector<Tensor> raw;
    for (const auto& c : cores_in) {
      TORCH_CHECK(c.dim() == 4, "ttm_matrix: cores must be (r0, n, m, r1)");
      raw.push_back(c.contiguous());
    }
    for (size_t b = 0; b < gates_in.size(); ++b) {
      TORCH_CHECK(raw[b].size(-1) == gates_in[b].size(0) &&
                      (*alive)[b].numel() == gates_in[b].size(0),
                  "ttm_matrix: gate ", b, " does not match its bond");
    }
    Tensor gm, m;  // the masked gate values (flat) and their mask, when gated
    const std::vector<Tensor> eff =
        absorb_gates(raw, gates_in.vec(), *alive, tau, right_sites(K), gm, m);
    // the chain; every prefix but the last kept for backward
    std::vector<Tensor> P = merge_left(eff, K);
    const Tensor last = P.back();  // (n_0 m_0 n_1 m_1 …, 1)
    P.pop_back();
    std::vector<int64_t> dims, perm;
    int64_t N = 1, M = 1;
    for (int64_t k = 0; k < K; ++k) {
      dims.push_back(raw[k].size(1));
      dims.push_back(raw[k].size(2));
      N *= raw[k].size(1);
      M *= raw[k].size(2);
    }
    for (int64_t k = 0; k < K; ++k) perm.push_back(2 * k);
    for (int64_t k = 0; k < K; ++k) perm.push_back(2 * k + 1);
    Tensor W = last.reshape(dims).permute(perm).reshape({N, M});
    if (!W.is_contiguous()) W = W.contiguous();
    ctx->set_materialize_grads(false);
    ctx->saved_data["raw"] = raw;
    ctx->saved_data["eff"] = eff;
    ctx->saved_data["prefixes"] = P;
    ctx->saved_data["gated"] = gm.defined();
    if (gm.defined()) {
      ctx->saved_data["gm"] = gm;
      ctx->saved_data["m"] = m;
    }
    ctx->saved_data["dims"] = dims;
    return {W};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto raw = ctx->saved_data["raw"].toTensorVector();
    const bool gated = ctx->saved_data["gated"].toBool();
    const int64_t K = static_cast<int64_t>(raw.size());
    const int64_t n_g = gated ? K - 1 : 0;
    variable_list out(K + n_g + 2);  // the cores, the gates, alive, tau
    const Tensor& dW = grads[0];
    if (!dW.defined()) return out;
    bool want_cores = false, want_gates = false;
    for (int64_t k = 0; k < K; ++k) want_cores = want_cores || ctx->needs_input_grad(k);
    for (int64_t b = 0; b < n_g; ++b) want_gates = want_gates || ctx->needs_input_grad(K + b);
    std::vector<Tensor> g(K + n_g);
    {
      const auto eff = ctx->saved_data["eff"].toTensorVector();
      const auto P = ctx->saved_data["prefixes"].toTensorVector();
      const auto dims = ctx->saved_data["dims"].toIntVector();
      // dW (N, M) back to the chain's mode order (n_0, m_0, n_1, m_1, …)
      std::vector<int64_t> split_dims, inv(2 * K);
      for (int64_t k = 0; k < K; ++k) split_dims.push_back(dims[2 * k]);
      for (int64_t k = 0; k < K; ++k) split_dims.push_back(dims[2 * k + 1]);
      for (int64_t k = 0; k < K; ++k) {
        inv[2 * k] = k;
        inv[2 * k + 1] = K + k;
      }
      const Tensor dlast = dW.reshape(split_dims).permute(inv).contiguous();
      const std::vector<Tensor> d_eff = merge_left_grads(dlast, eff, P, K);
      const Tensor gm = gated ? ctx->saved_data["gm"].toTensor() : Tensor();
      const Tensor m = gated ? ctx->saved_data["m"].toTensor() : Tensor();
      g = gate_grads(d_eff, raw, gm, m, right_sites(K), want_cores, want_gates);
    }
    for (int64_t i = 0; i < K + n_g; ++i) {
      if (ctx->needs_input_grad(i)) out[i] = g[i];
    }
    return out;
  }
};

}  // namespace

std::vector<Tensor> ttm_matrix(const std::vector<Tensor>& cores,
                               const std::vector<Tensor>& gates,
                               const std::vector<Tensor>& alive, double tau) {
  TORCH_CHECK(gates.size() == alive.size(), "ttm_matrix: ", gates.size(), " gates and ",
              alive.size(), " alive vectors");
  return TTMMatrix::apply(at::TensorList(cores), at::TensorList(gates), &alive, tau);
}

Tensor clip_grad_norm(const std::vector<Tensor>& grads, double max_norm) {
  // torch.nn.utils.clip_grad_norm_ (2-norm): the norm of all gradients together, then
  // every gradient times max_norm / (norm + 1e-6) where that is below 1 (or not a
  // number: a non-finite norm spreads as there). The sum of squares in double, the
  // coefficient and the scaling in the gradients' dtype.
  // Gradients it does not take (not all dense, contiguous, on the CPU, of one float
  // dtype): nothing done, an undefined tensor returned (None: the caller runs torch's).
  if (grads.empty()) return Tensor();
  const auto dtype = grads[0].scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return Tensor();
  for (const auto& g : grads) {
    if (!g.defined() || !g.is_cpu() || g.scalar_type() != dtype || !g.is_contiguous() ||
        g.layout() != at::kStrided) {
      return Tensor();
    }
  }
  Tensor norm;
  AT_DISPATCH_FLOATING_TYPES(dtype, "clip_grad_norm", [&] {
    double sq = 0.0;
    for (const auto& g : grads) {
      const scalar_t* __restrict__ p = g.data_ptr<scalar_t>();
      const int64_t n = g.numel();
      double s = 0.0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
      sq += s;
    }
    const auto total = static_cast<scalar_t>(std::sqrt(sq));
    const scalar_t coef = static_cast<scalar_t>(max_norm) / (total + static_cast<scalar_t>(1e-6));
    if (!(coef >= scalar_t(1))) {
      for (const auto& g : grads) {
        scalar_t* __restrict__ p = g.data_ptr<scalar_t>();
        for (int64_t i = 0, n = g.numel(); i < n; ++i) p[i] *= coef;
      }
    }
    norm = at::scalar_tensor(total, grads[0].options());
  });
  return norm;
}

}  // namespace comera
