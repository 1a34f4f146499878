// The batch-independent parts of the TT-linear halves path (TTLinearHalves in
// ops/tt_linear_halves.py) as two ATen functions: gates, the merge chains L = G_1⋯G_d and
// R = G_{d+1}⋯G_{2d}, the padded middle rank with the bias row, and back from dL, dR to
// every core and gate. A step then calls C++ twice instead of running ~40 small
// Python-level ops; its batch GEMMs are chosen in Python (tt_halves_batch.cpp). Same
// math and op order as the Python Function, which stays the reference (tests compare).
#include "tt_common.h"

namespace comera {

// Returns [Lp, Rp, gm, m, eff_0..eff_{2d-1}, P_1..P_{d-1}, Q_2..Q_d]: L and R (zero-
// padded to width rp when rp > 0, which padded_width in ops/tt_linear_halves.py gives,
// with the bias in row r_d of Rp), the gate values and mask (undefined without gates),
// the gated cores, the left prefixes P_k = G_1⋯G_k as (n_1⋯n_k, r_k) and the right
// suffixes Q_j = G_j⋯G_{2d} as (r_{j-1}, m_j⋯m_d).
std::vector<Tensor> halves_prepare(const std::vector<Tensor>& cores,
                                   const std::vector<Tensor>& gates,
                                   const std::vector<Tensor>& alive, double tau,
                                   const c10::optional<Tensor>& bias, int64_t d,
                                   int64_t rp) {
  at::AutoDispatchBelowADInplaceOrView guard;  // inside a Function: no autograd here
  Tensor gm, m;
  std::vector<Tensor> eff = absorb_gates(cores, gates, alive, tau, halves_sites(d), gm, m);
  std::vector<Tensor> P = merge_left(eff, d);
  std::vector<Tensor> Q{right_mat(eff[2 * d - 1])};  // built last to first
  for (int64_t j = 2 * d - 2; j >= d; --j) {
    const Tensor& G = eff[j];
    Q.push_back(at::mm(left_mat(G), Q.back()).reshape({G.size(0), -1}));
  }
  std::reverse(Q.begin(), Q.end());
  Tensor Lp = P.back(), Rp = Q.front();
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t rd = Lp.size(1);
  if (rp > 0 && rp != rd) {  // zero-pad r_d to rp; the bias in row r_d
    Lp = at::constant_pad_nd(Lp, {0, rp - rd}, 0);
    if (!has_bias) {
      Rp = at::constant_pad_nd(Rp, {0, 0, 0, rp - rd}, 0);
    } else {
      Tensor R = Rp;
      Rp = at::zeros({rp, R.size(1)}, R.options());
      Rp.narrow(0, 0, rd).copy_(R);
      Rp.select(0, rd).copy_(*bias);
    }
  }
  std::vector<Tensor> out{Lp, Rp, gm, m};
  out.insert(out.end(), eff.begin(), eff.end());
  out.insert(out.end(), P.begin(), P.end() - 1);
  out.insert(out.end(), Q.begin() + 1, Q.end());
  return out;
}

// From dL (the gradient of L, (N, r_d)) and dR ((r_d, M)) back through the merge chains
// to [d_core_0..d_core_{2d-1}, d_gate_0..d_gate_{2d-2}] (the raw cores' and gates';
// undefined where not asked for). P: P_1..P_{d-1}; Q: Q_2..Q_d.
std::vector<Tensor> halves_core_grads(const Tensor& dL, const Tensor& dR,
                                      const std::vector<Tensor>& raw,
                                      const std::vector<Tensor>& eff,
                                      const std::vector<Tensor>& P,
                                      const std::vector<Tensor>& Q,
                                      const c10::optional<Tensor>& gm_opt,
                                      const c10::optional<Tensor>& m_opt, int64_t d,
                                      bool need_cores, bool need_gates) {
  at::AutoDispatchBelowADInplaceOrView guard;
  std::vector<Tensor> d_eff = merge_left_grads(dL, eff, P, d);
  d_eff.resize(2 * d);
  Tensor dQ = dR;  // Q_j = G_j·Q_{j+1}, G_j: (r·m, r'), Q_{j+1}: (r', rest)
  for (int64_t j = 0; j < d - 1; ++j) {
    const Tensor& G = eff[d + j];
    Tensor dQj = dQ.reshape({G.size(0) * G.size(1), -1});
    d_eff[d + j] = at::mm(dQj, Q[j].t()).view(G.sizes());
    dQ = at::mm(left_mat(G).t(), dQj);
  }
  d_eff[2 * d - 1] = dQ.reshape(eff[2 * d - 1].sizes());
  const Tensor gm = gm_opt.has_value() ? *gm_opt : Tensor();
  const Tensor m = m_opt.has_value() ? *m_opt : Tensor();
  return gate_grads(d_eff, raw, gm, m, halves_sites(d), need_cores, need_gates);
}

}  // namespace comera
