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
#include <torch/csrc/autograd/custom_function.h>

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

namespace {

// Sums of the layout in double: S_hat, S and, in `grad` (the gates' dtype, one entry per
// gate entry, every one written), dS_hat/dg.
void surrogate_pass(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                    const std::vector<int64_t>& bonds, const std::vector<double>& modes,
                    const std::vector<double>& taus, const Tensor& grad, double& s_hat,
                    double& size) {
  s_hat = 0.0;
  size = 0.0;
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
          out[off] = (a[j] && std::abs(g[j]) > tau)
                         ? static_cast<scalar_t>(g[j] > 0 ? coeff : -coeff)
                         : scalar_t(0);
        }
      }
      b0 += nb;
      m0 += nb + 1;
    }
  });
}

Tensor checked_pass(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                    const std::vector<int64_t>& bonds, const std::vector<double>& modes,
                    const std::vector<double>& taus, double& s_hat, double& size) {
  check_layout(gates, alive, bonds, modes, taus);
  TORCH_CHECK(!gates.empty(), "gate_size: no gates");
  int64_t total = 0;
  for (const auto& g : gates) total += g.numel();
  Tensor grad = at::empty({total}, gates[0].options());
  surrogate_pass(gates, alive, bonds, modes, taus, grad, s_hat, size);
  return grad;
}

// A 0-d CPU tensor's value as T: read in place where it holds a T (no dispatch: the
// call runs right after a model's forward, where each small op costs several times its
// own time), else through item().
template <typename T>
T scalar_of(const Tensor& t) {
  if (t.scalar_type() == c10::CppTypeToScalarType<T>::value && t.numel() == 1) {
    return *t.data_ptr<T>();
  }
  return t.item<T>();
}

// A new 0-d tensor holding v (one allocation, no fill op).
template <typename T>
Tensor scalar_as(T v, const at::TensorOptions& options) {
  Tensor t = at::empty({}, options);
  *t.data_ptr<T>() = v;
  return t;
}

// One product in its own rounding: a compiler may not fuse it with a following sum into
// one fused multiply-add (the reference rounds every tensor op).
template <typename T>
T mul(T a, T b) {
  volatile T p = a * b;
  return p;
}

}  // namespace

std::vector<Tensor> gate_size(const std::vector<Tensor>& gates,
                              const std::vector<Tensor>& alive,
                              const std::vector<int64_t>& bonds,
                              const std::vector<double>& modes,
                              const std::vector<double>& taus, bool want_size) {
  double s_hat = 0.0, size = 0.0;
  Tensor grad = checked_pass(gates, alive, bonds, modes, taus, s_hat, size);
  Tensor s = at::scalar_tensor(s_hat, gates[0].options());
  Tensor cores = at::scalar_tensor(want_size ? size : 0.0,
                                   gates[0].options().dtype(at::kDouble));
  return {s, cores, grad};
}

BankLayout::BankLayout(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                       std::vector<int64_t> bonds_, std::vector<double> modes_,
                       std::vector<double> taus_)
    : bonds(std::move(bonds_)), modes(std::move(modes_)), taus(std::move(taus_)) {
  check_layout(gates, alive, bonds, modes, taus);
  TORCH_CHECK(!gates.empty(), "BankLayout: no gates");
  for (const auto& g : gates) sizes.push_back(g.numel());
}

void BankLayout::check(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive) const {
  TORCH_CHECK(gates.size() == sizes.size() && alive.size() == sizes.size(),
              "BankLayout: ", gates.size(), " gates for a layout of ", sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(gates[i].dim() == 1 && gates[i].numel() == sizes[i] &&
                    gates[i].is_contiguous() && gates[i].is_cpu() &&
                    gates[i].scalar_type() == gates[0].scalar_type() &&
                    alive[i].scalar_type() == at::kBool && alive[i].is_contiguous() &&
                    alive[i].numel() == sizes[i],
                "BankLayout: gate ", i, " or its alive vector is not the layout's");
  }
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The CoMERA objective's loss (rank/objective.py, CoMERAObjective._terms: the PyTorch
// reference) from the surrogate pass, every scalar op of the reference in the task
// loss's dtype T, rounded as the tensor op rounds it (a Python number as T, `x / y` of a
// number by a tensor as the reciprocal times the number); its backward multiplies and
// sums as autograd does through the reference's expressions. Inputs: the task loss `f`,
// the gates (the layout's), `side` (the early stage's gamma ramp, float32, or the late
// stage's loss averaged over processes) and the settings `p`: early {S0, gamma}, late
// {S0, extra, z_f, target size, rho_f, rho_s, Ŝ / S_c (1) or Ŝ / S0 (0), size terms off
// at the target (1) or on (0)}. Outputs: the loss, then (not differentiable) Ŝ in the
// gates' dtype, the early stage's gamma or the late stage's size, and lambda (late).
struct SizeObjective : public torch::autograd::Function<SizeObjective> {
  static variable_list forward(AutogradContext* ctx, const Tensor& f, at::TensorList gates,
                               const std::vector<Tensor>* alive, const BankLayout* layout,
                               const Tensor& side, bool late, const std::vector<double>& p) {
    TORCH_CHECK(f.dim() == 0 && f.is_cpu() && side.dim() == 0 && side.is_cpu(),
                "size_objective: the loss and its side value must be CPU scalars");
    TORCH_CHECK(p.size() == (late ? 8u : 2u), "size_objective: ", p.size(), " settings");
    const auto& L = *layout;
    double s_hat_d = 0.0, size_d = 0.0;
    int64_t total_n = 0;
    for (int64_t n : L.sizes) total_n += n;
    const std::vector<Tensor> gs = gates.vec();
    Tensor grad = at::empty({total_n}, gs[0].options());
    surrogate_pass(gs, *alive, L.bonds, L.modes, L.taus, grad, s_hat_d, size_d);
    Tensor s_raw = at::empty({}, gs[0].options());  // S_hat rounded to the gates' dtype
    double s_g = 0.0;
    AT_DISPATCH_FLOATING_TYPES(s_raw.scalar_type(), "size_objective_s", [&] {
      const auto v = static_cast<scalar_t>(s_hat_d);
      *s_raw.data_ptr<scalar_t>() = v;
      s_g = static_cast<double>(v);
    });
    std::vector<double> c(6, 0.0);  // the backward's: rho_f, c1..c4, S0
    Tensor out, first, lam;
    AT_DISPATCH_FLOATING_TYPES(f.scalar_type(), "size_objective", [&] {
      using T = scalar_t;
      const T fl = scalar_of<T>(f), S0 = static_cast<T>(p[0]);
      T s_hat = static_cast<T>(s_g) / S0, total, a, l = 0;
      c[5] = static_cast<double>(S0);
      if (!late) {
        const T gamma = mul(static_cast<T>(p[1]), static_cast<T>(scalar_of<float>(side)));
        total = fl + mul(gamma, s_hat);
        a = gamma;
        c[1] = static_cast<double>(gamma);
      } else {
        const T size = static_cast<T>(size_d + p[1]);
        const T z_f = static_cast<T>(p[2]), target = static_cast<T>(p[3]);
        const T rho_f = static_cast<T>(p[4]), rho_s = static_cast<T>(p[5]);
        T norm = 0;
        if (p[6] != 0.0) {
          const T cores = std::max(static_cast<T>(size_d), T(1));
          norm = mul(T(1) / cores, S0);
          s_hat = mul(s_hat, norm);
        }
        const T fv = scalar_of<T>(side);
        const T gap_f = fv != 0 ? (fv - z_f) / fv : T(0);
        const T gap_s = size > 0 ? (size - target) / size : T(-1);
        const T pursue = p[7] == 0.0 ? T(1) : (size > target ? T(1) : T(0));
        l = mul(gap_f < gap_s ? T(1) : T(0), pursue);
        const T on_s = mul(pursue, rho_s), off_f = T(1) - l;
        total = ((mul(rho_f, fl) + mul(on_s, s_hat)) + mul(l, s_hat)) + mul(off_f, fl);
        a = size;
        c[0] = static_cast<double>(rho_f);
        c[1] = static_cast<double>(on_s);
        c[2] = static_cast<double>(l);
        c[3] = static_cast<double>(norm);
        c[4] = static_cast<double>(off_f);
      }
      out = scalar_as<T>(total, f.options());
      first = scalar_as<T>(a, f.options());
      lam = scalar_as<T>(l, f.options());
    });
    ctx->mark_non_differentiable({s_raw, first, lam});
    ctx->set_materialize_grads(false);
    ctx->saved_data["grad"] = grad;
    ctx->saved_data["c"] = c;
    ctx->saved_data["late"] = late;
    ctx->saved_data["sizes"] = L.sizes;
    return {out, s_raw, first, lam};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& d = grads[0];
    const Tensor grad = ctx->saved_data["grad"].toTensor();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    variable_list out(1 + sizes.size() + 5);  // f, the gates, then the other arguments
    if (!d.defined()) return out;
    const auto c = ctx->saved_data["c"].toDoubleVector();
    const bool late = ctx->saved_data["late"].toBool();
    Tensor d_f;
    double d_s_v = 0.0;  // d_s in d's dtype, held exactly in a double
    AT_DISPATCH_FLOATING_TYPES(d.scalar_type(), "size_objective_grad", [&] {
      using T = scalar_t;
      const T dv = scalar_of<T>(d), S0 = static_cast<T>(c[5]);
      T df = dv, ds;
      if (!late) {
        ds = mul(dv, static_cast<T>(c[1])) / S0;
      } else {
        df = mul(dv, static_cast<T>(c[0])) + mul(dv, static_cast<T>(c[4]));
        ds = mul(dv, static_cast<T>(c[1])) + mul(dv, static_cast<T>(c[2]));
        if (c[3] != 0.0) ds = mul(ds, static_cast<T>(c[3]));
        ds = ds / S0;
      }
      // the early stage passes d on to the task loss as it came (d times nothing)
      d_f = late ? scalar_as<T>(df, d.options()) : d;
      d_s_v = static_cast<double>(ds);
    });
    if (ctx->needs_input_grad(0)) out[0] = d_f;
    // grad * d_s, d_s first rounded to the gates' dtype (as `grad * d_s.to(dtype)`)
    Tensor scaled = at::empty_like(grad);
    AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "size_objective_scale", [&] {
      const scalar_t* __restrict__ src = grad.data_ptr<scalar_t>();
      scalar_t* __restrict__ dst = scaled.data_ptr<scalar_t>();
      const auto m = static_cast<scalar_t>(d_s_v);
      for (int64_t i = 0, n = grad.numel(); i < n; ++i) dst[i] = src[i] * m;
    });
    auto parts = scaled.split_with_sizes(sizes);
    for (size_t i = 0; i < parts.size(); ++i) out[1 + i] = parts[i];
    return out;
  }
};

// Some live entry at or below its threshold (the layout checked by the caller).
bool any_dying(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
               const std::vector<int64_t>& bonds, const std::vector<double>& taus) {
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

}  // namespace

std::vector<Tensor> size_objective(const BankLayout& layout, const std::vector<Tensor>& gates,
                                   const std::vector<Tensor>& alive, const Tensor& f,
                                   const Tensor& side, bool late,
                                   const std::vector<double>& p) {
  layout.check(gates, alive);
  return SizeObjective::apply(f, at::TensorList(gates), &alive, &layout, side, late, p);
}

bool layout_dying(const BankLayout& layout, const std::vector<Tensor>& gates,
                  const std::vector<Tensor>& alive) {
  layout.check(gates, alive);
  return any_dying(gates, alive, layout.bonds, layout.taus);
}

}  // namespace comera
