// The rank gates' per-step work over a whole model in one call each: the size surrogate
// with its gradient and the cores' effective size (comera_engine/rank/size.py, gate_sizes:
// the PyTorch reference), and the refresh's check for entries at or below their threshold
// (comera_engine/rank/optim.py, refresh_gates).
//
// Layout (GateBank's): the gate vectors of every TT layer in order, layer l owning
// bonds[l] of them, its bonds[l]+1 mode sizes in `modes` and its threshold taus[l]. An
// entry is live when alive and |g| > tau. Per layer, with R_k the sum of |g| over bond k's
// live entries and C_k their count (R_0 = R_K = C_0 = C_K = 1 for the outer bonds):
//   S_hat = sum_k s_k R_{k-1} R_k,   S = sum_k s_k C_{k-1} C_k  (0 if some C_k = 0),
//   dS_hat/dg_j = sign(g_j) (s_k R_{k-1} + s_{k+1} R_{k+1}) for a live entry j of bond k.
// Sums are taken in double.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <vector>

#include "tt_common.h"

namespace comera {

namespace {

void check_layout(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                  const std::vector<int64_t>& bonds, const std::vector<double>& modes,
                  const std::vector<double>& taus) {
  int64_t n = 0, m = 0;
  for (int64_t b : bonds) {
    n += b;
    m += b + 1;
  }
  TORCH_CHECK(static_cast<int64_t>(gates.size()) == n && alive.size() == gates.size(),
              "gate_size: ", gates.size(), " gates and ", alive.size(),
              " alive vectors for ", n, " bonds");
  TORCH_CHECK(static_cast<int64_t>(modes.size()) == m && taus.size() == bonds.size(),
              "gate_size: mode sizes or thresholds do not match the layers");
  for (size_t i = 0; i < gates.size(); ++i) {
    TORCH_CHECK(gates[i].dim() == 1 && gates[i].is_contiguous() && gates[i].is_cpu() &&
                    gates[i].scalar_type() == gates[0].scalar_type(),
                "gate_size: gate ", i, " is not a contiguous CPU vector of the first's dtype");
    TORCH_CHECK(alive[i].scalar_type() == at::kBool && alive[i].is_contiguous() &&
                    alive[i].numel() == gates[i].numel(),
                "gate_size: alive ", i, " is not a bool vector of its gate's length");
  }
}

}  // namespace

std::vector<Tensor> gate_size(const std::vector<Tensor>& gates,
                              const std::vector<Tensor>& alive,
                              const std::vector<int64_t>& bonds,
                              const std::vector<double>& modes,
                              const std::vector<double>& taus, bool want_size) {
  check_layout(gates, alive, bonds, modes, taus);
  TORCH_CHECK(!gates.empty(), "gate_size: no gates");
  int64_t total = 0;
  for (const auto& g : gates) total += g.numel();
  Tensor grad = at::zeros({total}, gates[0].options());
  double s_hat = 0.0, size = 0.0;
  AT_DISPATCH_FLOATING_TYPES(gates[0].scalar_type(), "gate_size", [&] {
    scalar_t* out = grad.data_ptr<scalar_t>();
    std::vector<double> R, C;
    size_t b0 = 0, m0 = 0;
    int64_t off = 0;
    for (size_t l = 0; l < bonds.size(); ++l) {
      const int64_t nb = bonds[l];
      const scalar_t tau = static_cast<scalar_t>(taus[l]);  // compared as the reference does
      R.assign(nb + 2, 1.0);
      C.assign(nb + 2, 1.0);
      bool dead_bond = false;
      for (int64_t k = 0; k < nb; ++k) {
        const scalar_t* g = gates[b0 + k].data_ptr<scalar_t>();
        const bool* a = alive[b0 + k].data_ptr<bool>();
        double r = 0.0, c = 0.0;
        for (int64_t j = 0, n = gates[b0 + k].numel(); j < n; ++j) {
          const scalar_t v = std::abs(g[j]);
          if (a[j] && v > tau) {
            r += static_cast<double>(v);
            c += 1.0;
          }
        }
        R[k + 1] = r;
        C[k + 1] = c;
        dead_bond = dead_bond || c == 0.0;
      }
      double layer_size = 0.0;
      for (int64_t c = 0; c <= nb; ++c) {
        const double s = modes[m0 + c];
        s_hat += s * R[c] * R[c + 1];
        layer_size += s * C[c] * C[c + 1];
      }
      if (!dead_bond) size += layer_size;
      for (int64_t k = 0; k < nb; ++k) {  // bond k sits between cores k and k+1
        const double coeff = modes[m0 + k] * R[k] + modes[m0 + k + 1] * R[k + 2];
        const scalar_t* g = gates[b0 + k].data_ptr<scalar_t>();
        const bool* a = alive[b0 + k].data_ptr<bool>();
        for (int64_t j = 0, n = gates[b0 + k].numel(); j < n; ++j, ++off) {
          if (a[j] && std::abs(g[j]) > tau) {
            out[off] = static_cast<scalar_t>(g[j] > 0 ? coeff : -coeff);
          }
        }
      }
      b0 += nb;
      m0 += nb + 1;
    }
  });
  Tensor s = at::scalar_tensor(s_hat, gates[0].options());
  Tensor cores = at::scalar_tensor(want_size ? size : 0.0,
                                   gates[0].options().dtype(at::kDouble));
  return {s, cores, grad};
}

bool gates_dying(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                 const std::vector<int64_t>& bonds, const std::vector<double>& taus) {
  std::vector<double> modes;
  for (int64_t b : bonds) modes.resize(modes.size() + b + 1, 1.0);
  check_layout(gates, alive, bonds, modes, taus);
  bool dying = false;
  AT_DISPATCH_FLOATING_TYPES(gates.empty() ? at::kFloat : gates[0].scalar_type(),
                             "gates_dying", [&] {
    size_t b0 = 0;
    for (size_t l = 0; l < bonds.size() && !dying; ++l) {
      const scalar_t tau = static_cast<scalar_t>(taus[l]);
      for (int64_t k = 0; k < bonds[l] && !dying; ++k) {
        const scalar_t* g = gates[b0 + k].data_ptr<scalar_t>();
        const bool* a = alive[b0 + k].data_ptr<bool>();
        for (int64_t j = 0, n = gates[b0 + k].numel(); j < n; ++j) {
          if (a[j] && std::abs(g[j]) <= tau) {
            dying = true;
            break;
          }
        }
      }
      b0 += bonds[l];
    }
  });
  return dying;
}

}  // namespace comera
