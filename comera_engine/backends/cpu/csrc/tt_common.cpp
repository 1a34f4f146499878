// Rank gates inside the native TT-linear ops: absorbing them into the cores and their
// gradients (the C++ twin of GatedFunction._absorb / _gate_grads in ops/gates.py).
// Written as plain loops, one pass per core each way: the ATen version ran ~35 small ops
// a step (cat, hardshrink, where, a multiply per core, a multiply and a sum per gate in
// backward), and at small batches those per-op costs were a third of the whole step.
#include "tt_common.h"

#include <ATen/Dispatch.h>

#include <cmath>

namespace comera {

namespace {

// A core (r0, n, r1) as a matrix whose gated axis is the columns (right bond: rows =
// r0·n, cols = r1) or the rows (left bond: rows = r0, cols = n·r1).
struct GateLayout {
  int64_t rows, cols;
  bool right;
};

GateLayout layout_of(const Tensor& core, bool right) {
  const int64_t r = right ? core.size(-1) : core.size(0);
  return {right ? core.numel() / r : r, right ? r : core.numel() / r, right};
}

}  // namespace

std::vector<GateSite> halves_sites(int64_t d) {
  std::vector<GateSite> sites;
  for (int64_t b = 0; b < 2 * d - 1; ++b) sites.push_back({b < d ? b : b + 1, b < d});
  return sites;
}

std::vector<GateSite> right_sites(int64_t K) {
  std::vector<GateSite> sites;
  for (int64_t b = 0; b + 1 < K; ++b) sites.push_back({b, true});
  return sites;
}

std::vector<Tensor> absorb_gates(const std::vector<Tensor>& cores,
                                 const std::vector<Tensor>& gates,
                                 const std::vector<Tensor>& alive, double tau,
                                 const std::vector<GateSite>& sites, Tensor& gm, Tensor& m) {
  std::vector<Tensor> eff(cores.begin(), cores.end());
  if (gates.empty()) return eff;
  int64_t total = 0;
  for (const auto& g : gates) total += g.size(0);
  gm = at::empty({total}, gates[0].options());
  m = at::empty({total}, gates[0].options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(gm.scalar_type(), "absorb_gates", [&] {
    scalar_t* pg = gm.data_ptr<scalar_t>();
    bool* pm = m.data_ptr<bool>();
    const auto t = static_cast<scalar_t>(tau);  // hardshrink compares in the gate dtype
    int64_t off = 0;
    for (size_t b = 0; b < sites.size(); ++b) {
      // g where alive and |g| > tau, else 0; the mask: the entries kept (nonzero)
      const Tensor g = gates[b].contiguous();
      const Tensor a = alive.empty() ? Tensor() : alive[b].contiguous();
      const scalar_t* s = g.data_ptr<scalar_t>();
      const bool* pa = a.defined() ? a.data_ptr<bool>() : nullptr;
      const int64_t r = g.size(0);
      for (int64_t i = 0; i < r; ++i) {
        const scalar_t v = (std::abs(s[i]) > t && (pa == nullptr || pa[i])) ? s[i] : 0;
        pg[off + i] = v;
        pm[off + i] = v != 0;
      }
      // the gated core: its right bond (input half, middle) or left bond scaled by v
      const int64_t j = sites[b].core;
      const Tensor c = cores[j].contiguous();
      const GateLayout L = layout_of(c, sites[b].right);
      Tensor e = at::empty_like(c);
      const scalar_t* __restrict__ pc = c.data_ptr<scalar_t>();
      scalar_t* __restrict__ pe = e.data_ptr<scalar_t>();
      const scalar_t* __restrict__ v = pg + off;
      for (int64_t i = 0; i < L.rows; ++i) {
        const scalar_t* __restrict__ ci = pc + i * L.cols;
        scalar_t* __restrict__ ei = pe + i * L.cols;
        if (L.right) {
          for (int64_t k = 0; k < L.cols; ++k) ei[k] = ci[k] * v[k];
        } else {
          const scalar_t vi = v[i];
          for (int64_t k = 0; k < L.cols; ++k) ei[k] = ci[k] * vi;
        }
      }
      eff[j] = e;
      off += r;
    }
  });
  return eff;
}

std::vector<Tensor> gate_grads(const std::vector<Tensor>& d_eff,
                               const std::vector<Tensor>& raw, const Tensor& gm,
                               const Tensor& m, const std::vector<GateSite>& sites,
                               bool need_cores, bool need_gates) {
  std::vector<Tensor> out;
  if (!gm.defined()) {
    for (const auto& g : d_eff) out.push_back(need_cores ? g : Tensor());
    return out;
  }
  // E = G·diag(v) (right bond) or diag(v)·G (left): dG = dE·v, dg = m ⊙ Σ dE ⊙ G over
  // the core's other axes (summed in the gate dtype, row by row: vectorizes)
  std::vector<Tensor> d_raw(d_eff.begin(), d_eff.end());
  // one new vector per gate (no views of a shared one: each view is a dispatch)
  std::vector<Tensor> d_gates(need_gates ? sites.size() : 0);
  AT_DISPATCH_FLOATING_TYPES(gm.scalar_type(), "gate_grads", [&] {
    const scalar_t* pg = gm.data_ptr<scalar_t>();
    const bool* pm = m.data_ptr<bool>();
    int64_t off = 0;
    std::vector<scalar_t> acc;
    for (size_t b = 0; b < sites.size(); ++b) {
      const int64_t j = sites[b].core;
      const GateLayout L = layout_of(raw[j], sites[b].right);
      const int64_t r = L.right ? L.cols : L.rows;
      scalar_t* pf = nullptr;
      if (need_gates) {
        d_gates[b] = cpu_empty({r}, gm.scalar_type());
        pf = d_gates[b].data_ptr<scalar_t>();
      }
      const scalar_t* v = pg + off;
      if (!d_eff[j].defined()) {  // no gradient reached this core: zero for its gate
        if (pf != nullptr) std::fill(pf, pf + r, scalar_t(0));
        off += r;
        continue;
      }
      const Tensor dE = d_eff[j].contiguous();
      const Tensor G = raw[j].contiguous();
      const scalar_t* __restrict__ pe = dE.data_ptr<scalar_t>();
      const scalar_t* __restrict__ pc = G.data_ptr<scalar_t>();
      Tensor dG = need_cores ? at::empty_like(dE) : Tensor();
      scalar_t* __restrict__ pd = need_cores ? dG.data_ptr<scalar_t>() : nullptr;
      acc.assign(r, scalar_t(0));
      scalar_t* __restrict__ pa = acc.data();
      for (int64_t i = 0; i < L.rows; ++i) {
        const scalar_t* __restrict__ ei = pe + i * L.cols;
        const scalar_t* __restrict__ ci = pc + i * L.cols;
        if (L.right) {
          if (pd != nullptr) {
            scalar_t* __restrict__ di = pd + i * L.cols;
            for (int64_t k = 0; k < L.cols; ++k) di[k] = ei[k] * v[k];
          }
          if (pf != nullptr) {
            for (int64_t k = 0; k < L.cols; ++k) pa[k] += ei[k] * ci[k];
          }
        } else {
          if (pd != nullptr) {
            scalar_t* __restrict__ di = pd + i * L.cols;
            const scalar_t vi = v[i];
            for (int64_t k = 0; k < L.cols; ++k) di[k] = ei[k] * vi;
          }
          if (pf != nullptr) {
            scalar_t s = 0;
            for (int64_t k = 0; k < L.cols; ++k) s += ei[k] * ci[k];
            pa[i] = s;
          }
        }
      }
      if (pf != nullptr) {
        for (int64_t k = 0; k < r; ++k) pf[k] = pm[off + k] ? pa[k] : 0;
      }
      if (need_cores) d_raw[j] = dG;
      off += r;
    }
  });
  for (auto& g : d_raw) out.push_back(need_cores ? g : Tensor());
  if (need_gates) {
    for (auto& g : d_gates) out.push_back(g);
  } else {
    out.resize(out.size() + sites.size());
  }
  return out;
}

std::vector<Tensor> merge_left(const std::vector<Tensor>& cores, int64_t n) {
  std::vector<Tensor> P{left_mat(cores[0])};
  for (int64_t k = 1; k < n; ++k) {
    const Tensor& G = cores[k];
    P.push_back(at::mm(P.back(), right_mat(G)).reshape({-1, G.size(-1)}));
  }
  return P;
}

std::vector<Tensor> merge_left_grads(Tensor dP, const std::vector<Tensor>& cores,
                                     const std::vector<Tensor>& P, int64_t n) {
  std::vector<Tensor> d_cores(n);  // P_k = P_{k-1}·G_k, P_{k-1}: (a, r), G_k: (r, rest)
  for (int64_t k = n - 1; k > 0; --k) {
    const Tensor& G = cores[k];
    Tensor dPk = dP.reshape({-1, G.numel() / G.size(0)});
    d_cores[k] = at::mm(P[k - 1].t(), dPk).view(G.sizes());
    dP = at::mm(dPk, right_mat(G).t());
  }
  d_cores[0] = dP.reshape(cores[0].sizes());
  return d_cores;
}

Tensor transposed(const Tensor& a) {
  // large ones: ATen's copy, which runs on every thread
  if (a.dim() != 2 || !a.is_contiguous() || a.numel() == 0 || a.numel() > (1 << 17)) {
    return a.t().contiguous();
  }
  const int64_t R = a.size(0), C = a.size(1);
  Tensor out = at::empty({C, R}, a.options());
  constexpr int64_t kTile = 16;  // a 16×16 tile of each side stays in L1
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "transposed", [&] {
    const scalar_t* __restrict__ src = a.data_ptr<scalar_t>();
    scalar_t* __restrict__ dst = out.data_ptr<scalar_t>();
    for (int64_t i0 = 0; i0 < R; i0 += kTile) {
      const int64_t i1 = std::min(R, i0 + kTile);
      for (int64_t j0 = 0; j0 < C; j0 += kTile) {
        const int64_t j1 = std::min(C, j0 + kTile);
        for (int64_t j = j0; j < j1; ++j) {
          for (int64_t i = i0; i < i1; ++i) dst[j * R + i] = src[i * C + j];
        }
      }
    }
  });
  return out;
}

}  // namespace comera
