// The TT-linear sweep path (TTLinearSweep, ops/tt_linear_sweep.py) as two ATen functions, so a
// step runs its ~70 small ops without the Python interpreter between them: at 32 rows
// the Python bodies cost more than the GEMMs. Same math, same op order, same saved
// tensors as the Python Function, which stays the reference (tests compare the two).
#include "tt_common.h"

namespace comera {

// Returns [y, gm, m, eff_0..eff_{2d-1}, mats..., ins...]; gm and m are undefined
// without gates. mats: the swept matrices (input half (r0·n, r1), output half
// (r0, m·r1), outer pairs merged where head/tail); ins: each swept matrix's input.
std::vector<Tensor> sweep_forward(const Tensor& x, const std::vector<Tensor>& cores,
                                  const std::vector<Tensor>& gates,
                                  const std::vector<Tensor>& alive, double tau,
                                  const c10::optional<Tensor>& bias, int64_t d, bool head,
                                  bool tail) {
  at::AutoDispatchBelowADInplaceOrView guard;  // inside a Function: no autograd here
  Tensor gm, m;
  std::vector<Tensor> eff = absorb_gates(cores, gates, alive, tau, halves_sites(d), gm, m);
  std::vector<Tensor> ml, mr;
  for (int64_t k = 0; k < d; ++k) ml.push_back(left_mat(eff[k]));
  for (int64_t k = d; k < 2 * d; ++k) mr.push_back(right_mat(eff[k]));
  if (head) {  // H = G_1·G_2, one (n_1·n_2, r_2) matrix
    Tensor H = at::mm(ml[0], right_mat(eff[1])).view({-1, ml[1].size(1)});
    ml.erase(ml.begin());
    ml[0] = H;
  }
  if (tail) {  // G_{2d-1}·G_{2d}, one (r, m_{d-1}·m_d) matrix
    size_t n = mr.size();
    Tensor T2 = at::mm(left_mat(eff[2 * d - 2]), mr[n - 1]).view({mr[n - 2].size(0), -1});
    mr.pop_back();
    mr.back() = T2;
  }
  const int64_t B = x.size(0);
  std::vector<Tensor> ins;
  Tensor T = transposed(x);  // (N, B)
  for (const auto& A : ml) {
    T = T.view({A.size(0), -1});
    ins.push_back(T);
    T = at::mm(A.t(), T);  // (r1, rest·B)
  }
  Tensor S = T.t();  // (B, r_d)
  for (const auto& A : mr) {
    S = S.reshape({-1, A.size(0)});
    ins.push_back(S);
    S = at::mm(S, A);
  }
  Tensor y = S.view({B, -1});
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  std::vector<Tensor> out{y, gm, m};
  out.insert(out.end(), eff.begin(), eff.end());
  out.insert(out.end(), ml.begin(), ml.end());
  out.insert(out.end(), mr.begin(), mr.end());
  out.insert(out.end(), ins.begin(), ins.end());
  return out;
}

// Returns [dx, dbias, d_core_0..d_core_{2d-1}, d_gate_0..d_gate_{2d-2}] (gradients of
// the raw cores and gates; undefined where not asked for).
std::vector<Tensor> sweep_backward(const Tensor& dy, const std::vector<Tensor>& raw,
                                   const std::vector<Tensor>& eff,
                                   const std::vector<Tensor>& mats,
                                   const std::vector<Tensor>& ins,
                                   const c10::optional<Tensor>& gm_opt,
                                   const c10::optional<Tensor>& m_opt, int64_t d, int64_t nl,
                                   bool head,
                                   bool tail, bool need_x, bool need_bias, bool need_cores,
                                   bool need_gates) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const Tensor gm = gm_opt.has_value() ? *gm_opt : Tensor();
  const Tensor m = m_opt.has_value() ? *m_opt : Tensor();
  const int64_t ne = static_cast<int64_t>(mats.size());
  const bool gated = gm.defined();
  const bool want_w = need_cores || need_gates;
  std::vector<Tensor> dm(ne);
  Tensor dbias = need_bias ? dy.sum(0) : Tensor();
  Tensor dS = dy;
  for (int64_t k = ne - 1; k >= nl; --k) {  // output half, last matrix first
    const Tensor& A = mats[k];
    dS = dS.reshape({-1, A.size(1)});
    if (want_w) dm[k] = at::mm(ins[k].t(), dS);  // (r0, m·r1)
    dS = at::mm(dS, A.t());                      // (rows, r0)
  }
  Tensor dT = dS.t();  // (r_d, B)
  for (int64_t k = nl - 1; k >= 0; --k) {  // input half
    const Tensor& A = mats[k];
    dT = dT.reshape({A.size(1), -1});
    if (want_w) dm[k] = at::mm(ins[k], dT.t());  // (r0·n, r1)
    if (k > 0 || need_x) dT = at::mm(A, dT);     // (r0·n, rest·B)
  }
  // dX laid out (B, N), as x is: AccumulateGrad and the layer below would copy a
  // transposed view anyway, and this copy is faster than theirs
  Tensor dx = need_x ? transposed(dT.view({-1, dy.size(0)})) : Tensor();
  std::vector<Tensor> out{dx, dbias};
  if (!want_w) {
    out.resize(2 + 2 * d + (gated ? 2 * d - 1 : 0));
    return out;
  }
  // gradients of the (gated) cores, back through the head/tail merges
  std::vector<Tensor> lg(dm.begin(), dm.begin() + nl), rg(dm.begin() + nl, dm.end());
  if (head) {  // H = P_1·G_2 (P_1 = G_1 as a matrix)
    const Tensor &G1 = eff[0], &G2 = eff[1];
    Tensor dH = lg[0].view({-1, G2.size(1) * G2.size(2)});  // (n_1, n_2·r_2)
    Tensor g1 = at::mm(dH, right_mat(G2).t());
    Tensor g2 = at::mm(left_mat(G1).t(), dH);
    lg.erase(lg.begin());
    lg.insert(lg.begin(), g2);
    lg.insert(lg.begin(), g1);
  }
  if (tail) {  // G_a·Q_b (Q_b = G_b as a matrix)
    const Tensor &Ga = eff[2 * d - 2], &Gb = eff[2 * d - 1];
    Tensor dT2 = rg.back().view({-1, Gb.size(1)});  // (r_a·m_a, m_b)
    Tensor ga = at::mm(dT2, right_mat(Gb).t());
    Tensor gb = at::mm(left_mat(Ga).t(), dT2);
    rg.pop_back();
    rg.push_back(ga);
    rg.push_back(gb);
  }
  std::vector<Tensor> d_eff;
  for (int64_t k = 0; k < 2 * d; ++k) {
    const Tensor& g = k < static_cast<int64_t>(lg.size()) ? lg[k] : rg[k - lg.size()];
    d_eff.push_back(g.view(eff[k].sizes()));
  }
  std::vector<Tensor> g = gate_grads(d_eff, raw, gm, m, halves_sites(d), need_cores, need_gates);
  out.insert(out.end(), g.begin(), g.end());
  return out;
}

}  // namespace comera
