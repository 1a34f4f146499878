// Rank gates inside the native TT-linear ops: absorbing them into the cores and their
// gradients (the C++ twin of _GatedFunction._absorb / _gate_grads in contract.py).
#include "tt_common.h"

namespace comera {

std::vector<Tensor> absorb_gates(const std::vector<Tensor>& cores,
                                 const std::vector<Tensor>& gates,
                                 const std::vector<Tensor>& alive, double tau, int64_t d,
                                 Tensor& gm, Tensor& m) {
  std::vector<Tensor> eff(cores.begin(), cores.end());
  if (gates.empty()) return eff;
  gm = at::hardshrink(at::cat(gates), tau);  // g where |g| > tau, else 0
  if (!alive.empty()) gm = at::where(at::cat(alive), gm, 0.0);
  m = gm.ne(0);
  int64_t off = 0;
  for (int64_t b = 0; b < 2 * d - 1; ++b) {
    const int64_t r = gates[b].size(0);
    Tensor v = gm.narrow(0, off, r);
    off += r;
    const int64_t j = gate_core(b, d);
    eff[j] = gate_right(b, d) ? cores[j] * v : cores[j] * v.view({-1, 1, 1});
  }
  return eff;
}

std::vector<Tensor> gate_grads(const std::vector<Tensor>& d_eff,
                               const std::vector<Tensor>& raw, const Tensor& gm,
                               const Tensor& m, int64_t d, bool need_cores,
                               bool need_gates) {
  std::vector<Tensor> out;
  if (!gm.defined()) {
    for (const auto& g : d_eff) out.push_back(need_cores ? g : Tensor());
    return out;
  }
  // E = G·diag(v) (right bond) or diag(v)·G (left): dG = dE·v, dg = m ⊙ Σ dE ⊙ G over
  // the core's other axes
  std::vector<Tensor> d_raw(d_eff.begin(), d_eff.end()), sums;
  std::vector<int64_t> sizes;
  int64_t off = 0;
  for (int64_t b = 0; b < 2 * d - 1; ++b) {
    const int64_t j = gate_core(b, d);
    const bool right = gate_right(b, d);
    const int64_t r = raw[j].size(right ? -1 : 0);
    sizes.push_back(r);
    Tensor v = gm.narrow(0, off, r);
    off += r;
    const Tensor& dE = d_eff[j];
    if (need_cores) d_raw[j] = right ? dE * v : dE * v.view({-1, 1, 1});
    if (need_gates) {
      sums.push_back(right ? (dE * raw[j]).sum(at::IntArrayRef{0, 1})
                           : (dE * raw[j]).sum(at::IntArrayRef{1, 2}));
    }
  }
  for (auto& g : d_raw) out.push_back(need_cores ? g : Tensor());
  if (need_gates) {
    Tensor flat = at::where(m, at::cat(sums), 0.0);
    int64_t o = 0;
    for (int64_t r : sizes) {
      out.push_back(flat.narrow(0, o, r));
      o += r;
    }
  } else {
    out.resize(out.size() + 2 * d - 1);
  }
  return out;
}

}  // namespace comera
