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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

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

// One layer's share of the pass (module comment): bond k of its nb holds lens[k] entries
// of values vals[k], live(k, j) says whether entry j counts; its nb+1 mode sizes. Returns
// the layer's S_hat and S, each summed in double, and writes dS_hat/dg of every entry to
// `out` (the bonds in order) unless it is null.
template <typename scalar_t, typename Live>
LayerSize layer_pass(int64_t nb, const int64_t* lens, const scalar_t* const* vals,
                     const Live& live, const double* modes, scalar_t* out) {
  std::vector<double> R(nb + 2, 1.0), C(nb + 2, 1.0);
  bool dead_bond = false;
  for (int64_t k = 0; k < nb; ++k) {
    const scalar_t* g = vals[k];
    double r = 0.0, c = 0.0;
    for (int64_t j = 0; j < lens[k]; ++j) {
      if (live(k, j)) {
        r += static_cast<double>(std::abs(g[j]));
        c += 1.0;
      }
    }
    R[k + 1] = r;
    C[k + 1] = c;
    dead_bond = dead_bond || c == 0.0;
  }
  LayerSize res{0.0, 0.0};
  for (int64_t c = 0; c <= nb; ++c) {
    res.s_hat += modes[c] * R[c] * R[c + 1];
    res.size += modes[c] * C[c] * C[c + 1];
  }
  if (dead_bond) res.size = 0.0;
  if (out == nullptr) return res;
  for (int64_t k = 0; k < nb; ++k) {  // bond k sits between cores k and k+1
    const double coeff = modes[k] * R[k] + modes[k + 1] * R[k + 2];
    const scalar_t* g = vals[k];
    for (int64_t j = 0; j < lens[k]; ++j, ++out) {
      *out = live(k, j) ? static_cast<scalar_t>(g[j] > 0 ? coeff : -coeff) : scalar_t(0);
    }
  }
  return res;
}

// Sums of the layout in double, layer by layer (each layer's sum, then their sum in
// order: what the objective adds up from the layers' own nodes, layer_surrogate): S_hat,
// S and, in `grad` (the gates' dtype, one entry per gate entry, every one written),
// dS_hat/dg. An entry counts where alive and |g| > tau.
void surrogate_pass(const std::vector<Tensor>& gates, const std::vector<Tensor>& alive,
                    const std::vector<int64_t>& bonds, const std::vector<double>& modes,
                    const std::vector<double>& taus, const Tensor& grad, double& s_hat,
                    double& size) {
  s_hat = 0.0;
  size = 0.0;
  AT_DISPATCH_FLOATING_TYPES(gates[0].scalar_type(), "gate_size", [&] {
    scalar_t* out = grad.data_ptr<scalar_t>();
    std::vector<const scalar_t*> vals;
    std::vector<const bool*> on;
    std::vector<int64_t> lens;
    size_t b0 = 0, m0 = 0;
    for (size_t l = 0; l < bonds.size(); ++l) {
      const int64_t nb = bonds[l];
      const auto tau = static_cast<scalar_t>(taus[l]);  // compared as the reference does
      vals.clear();
      on.clear();
      lens.clear();
      for (int64_t k = 0; k < nb; ++k) {
        vals.push_back(gates[b0 + k].data_ptr<scalar_t>());
        on.push_back(alive[b0 + k].data_ptr<bool>());
        lens.push_back(gates[b0 + k].numel());
      }
      const auto live = [&](int64_t k, int64_t j) {
        return on[k][j] && std::abs(vals[k][j]) > tau;
      };
      const LayerSize ls =
          layer_pass<scalar_t>(nb, lens.data(), vals.data(), live, modes.data() + m0, out);
      s_hat += ls.s_hat;
      size += ls.size;
      for (int64_t n : lens) out += n;
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

// A new 0-d CPU tensor of T holding v (one allocation, no fill op).
template <typename T>
Tensor scalar_as(T v) {
  Tensor t = cpu_empty({}, c10::CppTypeToScalarType<T>::value);
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

LayerSize layer_surrogate(const Tensor& gm, const Tensor& m, const std::vector<int64_t>& lens,
                          const std::vector<double>& modes, const Tensor& grad) {
  int64_t total = 0;
  for (int64_t n : lens) total += n;
  TORCH_CHECK(!lens.empty() && modes.size() == lens.size() + 1,
              "layer_surrogate: ", lens.size(), " bonds and ", modes.size(), " mode sizes");
  TORCH_CHECK(gm.dim() == 1 && gm.is_contiguous() && gm.numel() == total &&
                  m.scalar_type() == at::kBool && m.is_contiguous() && m.numel() == total,
              "layer_surrogate: the gate values or their mask do not hold ", total,
              " entries");
  TORCH_CHECK(!grad.defined() || (grad.is_contiguous() && grad.numel() == total &&
                                  grad.scalar_type() == gm.scalar_type()),
              "layer_surrogate: the gradient is not a vector like the gate values");
  LayerSize res{0.0, 0.0};
  AT_DISPATCH_FLOATING_TYPES(gm.scalar_type(), "layer_surrogate", [&] {
    const scalar_t* v = gm.data_ptr<scalar_t>();
    const bool* pm = m.data_ptr<bool>();
    std::vector<const scalar_t*> vals;
    std::vector<int64_t> start;
    int64_t off = 0;
    for (int64_t n : lens) {
      vals.push_back(v + off);
      start.push_back(off);
      off += n;
    }
    const auto live = [&](int64_t k, int64_t j) { return pm[start[k] + j]; };
    res = layer_pass<scalar_t>(static_cast<int64_t>(lens.size()), lens.data(), vals.data(),
                               live, modes.data(),
                               grad.defined() ? grad.data_ptr<scalar_t>() : nullptr);
  });
  return res;
}

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

using torch::autograd::variable_list;

// The CoMERA objective's loss (rank/objective.py, CoMERAObjective._terms: the PyTorch
// reference) from the surrogate's sums, every scalar op of the reference in the task
// loss's dtype T, rounded as the tensor op rounds it (a Python number as T, `x / y` of a
// number by a tensor as the reciprocal times the number); its backward multiplies and
// sums as autograd does through the reference's expressions. `side`: the early stage's
// gamma ramp (float32) or the late stage's loss averaged over processes; the settings
// `p`: early {S0, gamma}, late {S0, extra, z_f, target size, rho_f, rho_s, Ŝ / S_c (1) or
// Ŝ / S0 (0), size terms off at the target (1) or on (0)}. Returns the loss, then (not
// differentiable) Ŝ in `gate_dtype`, the early stage's gamma or the late stage's size, and
// lambda (late); sets `c`, what the backward needs.
std::vector<Tensor> objective_forward(const Tensor& f, const Tensor& side, bool late,
                                      const std::vector<double>& p, double s_hat_d,
                                      double size_d, at::ScalarType gate_dtype,
                                      std::vector<double>& c) {
  TORCH_CHECK(f.dim() == 0 && f.is_cpu() && side.dim() == 0 && side.is_cpu(),
              "size_objective: the loss and its side value must be CPU scalars");
  TORCH_CHECK(p.size() == (late ? 8u : 2u), "size_objective: ", p.size(), " settings");
  Tensor s_raw = cpu_empty({}, gate_dtype);  // S_hat in the gates' dtype
  double s_g = 0.0;
  AT_DISPATCH_FLOATING_TYPES(s_raw.scalar_type(), "size_objective_s", [&] {
    const auto v = static_cast<scalar_t>(s_hat_d);
    *s_raw.data_ptr<scalar_t>() = v;
    s_g = static_cast<double>(v);
  });
  c.assign(6, 0.0);  // the backward's: rho_f, c1..c4, S0
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
    out = scalar_as<T>(total);
    first = scalar_as<T>(a);
    lam = scalar_as<T>(l);
  });
  return {out, s_raw, first, lam};
}

// The backward of objective_forward: from d = dL/d(loss) to dL/df (d itself in the early
// stage, as autograd passes it on) and dL/dŜ in d's dtype, held exactly in `d_s`.
Tensor objective_backward(const Tensor& d, const std::vector<double>& c, bool late,
                          double& d_s) {
  Tensor d_f;
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
    d_f = late ? scalar_as<T>(df) : d;
    d_s = static_cast<double>(ds);
  });
  return d_f;
}

// The backward of the objective over a layout (objective_forward, Ŝ from the surrogate
// pass over its gates; size_objective below), a plain autograd node (see
// LayerSizesBackward). Edges: the task loss `f`, then the gates; a gate's gradient is
// dŜ/dg times dL/dŜ.
struct SizeObjectiveBackward : public torch::autograd::Node {
  Tensor grad;                 // dŜ/dg of every entry, flat
  std::vector<int64_t> sizes;  // the gates' lengths
  std::vector<double> c;       // objective_forward's
  bool late = false;

  variable_list apply(variable_list&& grads) override {
    variable_list out(num_outputs());
    const Tensor& d = grads[0];
    if (!d.defined()) return out;
    double d_s_v = 0.0;
    Tensor d_f = objective_backward(d, c, late, d_s_v);
    if (task_should_compute_output(0)) out[0] = std::move(d_f);
    // grad * d_s, d_s first rounded to the gates' dtype (as `grad * d_s.to(dtype)`)
    Tensor scaled = cpu_empty(grad.sizes(), grad.scalar_type());
    AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "size_objective_scale", [&] {
      const scalar_t* __restrict__ src = grad.data_ptr<scalar_t>();
      scalar_t* __restrict__ dst = scaled.data_ptr<scalar_t>();
      const auto m = static_cast<scalar_t>(d_s_v);
      for (int64_t i = 0, n = grad.numel(); i < n; ++i) dst[i] = src[i] * m;
    });
    auto parts = scaled.split_with_sizes(sizes);
    for (size_t i = 0; i < parts.size(); ++i) {
      if (task_should_compute_output(1 + i)) out[1 + i] = parts[i];
    }
    return out;
  }

  void release_variables() override { grad.reset(); }

  std::string name() const override { return "CoMERAObjectiveOverGatesBackward"; }
};

// The backward of the objective over the {Ŝ_l, S_l} pairs the layers' own nodes output
// (ttm_matrix with its size output, layer_surrogate; size_objective_layers below): a plain
// autograd node, its settings held as members (a Function's context costs a map of boxed
// values each way, more than the arithmetic here). Edges: the task loss `f`, then each
// layer's pair; the pair's gradient is {dL/dŜ, 0} (float64, holding the value in the
// loss's dtype exactly), which the layer's node rounds to the gates' dtype and multiplies
// into its dŜ_l/dg, as SizeObjective does.
struct LayerSizesBackward : public torch::autograd::Node {
  std::vector<double> c;  // objective_forward's
  bool late = false;

  variable_list apply(variable_list&& grads) override {
    const size_t n = num_outputs();
    variable_list out(n);
    const Tensor& d = grads[0];
    if (!d.defined()) return out;
    double d_s_v = 0.0;
    Tensor d_f = objective_backward(d, c, late, d_s_v);
    if (task_should_compute_output(0)) out[0] = std::move(d_f);
    Tensor d_s;
    for (size_t l = 1; l < n; ++l) {
      if (!task_should_compute_output(l)) continue;
      if (!d_s.defined()) {
        d_s = cpu_empty({2}, at::kDouble);
        d_s.data_ptr<double>()[0] = d_s_v;
        d_s.data_ptr<double>()[1] = 0.0;
      }
      out[l] = d_s;
    }
    return out;
  }

  std::string name() const override { return "CoMERAObjectiveOverLayersBackward"; }
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
  double s_hat_d = 0.0, size_d = 0.0;
  int64_t total_n = 0;
  for (int64_t n : layout.sizes) total_n += n;
  Tensor grad = cpu_empty({total_n}, gates[0].scalar_type());
  surrogate_pass(gates, alive, layout.bonds, layout.modes, layout.taus, grad, s_hat_d, size_d);
  std::vector<double> c;
  std::vector<Tensor> res = objective_forward(f, side, late, p, s_hat_d, size_d,
                                              gates[0].scalar_type(), c);
  const at::TensorList gs(gates);
  if (torch::autograd::compute_requires_grad(f, gs)) {
    auto node = c10::make_intrusive<SizeObjectiveBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(f, gs));
    node->grad = std::move(grad);
    node->sizes = layout.sizes;
    node->c = std::move(c);
    node->late = late;
    torch::autograd::set_history(res[0], node);
  }
  return res;
}

std::vector<Tensor> size_objective_layers(const std::vector<Tensor>& sized, const Tensor& f,
                                          const Tensor& side, bool late,
                                          const std::vector<double>& p, bool double_gates) {
  // a task loss it does not take (not a float32/float64 CPU scalar): nothing made, an
  // empty list returned (the caller runs its other path)
  if (!f.defined() || f.dim() != 0 || !f.is_cpu() ||
      (f.scalar_type() != at::kFloat && f.scalar_type() != at::kDouble)) {
    return {};
  }
  // Ŝ = Σ Ŝ_l and S = Σ S_l in layer order, as surrogate_pass adds them up
  TORCH_CHECK(!sized.empty(), "size_objective_layers: no layer");
  double s_hat_d = 0.0, size_d = 0.0;
  for (size_t l = 0; l < sized.size(); ++l) {
    TORCH_CHECK(sized[l].dim() == 1 && sized[l].numel() == 2 && sized[l].is_cpu() &&
                    sized[l].scalar_type() == at::kDouble && sized[l].is_contiguous(),
                "size_objective_layers: layer ", l, "'s sizes are not a float64 pair");
    const double* v = sized[l].data_ptr<double>();
    s_hat_d += v[0];
    size_d += v[1];
  }
  std::vector<double> c;
  std::vector<Tensor> res = objective_forward(f, side, late, p, s_hat_d, size_d,
                                              double_gates ? at::kDouble : at::kFloat, c);
  const at::TensorList pairs(sized);
  if (torch::autograd::compute_requires_grad(f, pairs)) {  // the loss alone has a history
    auto node = c10::make_intrusive<LayerSizesBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(f, pairs));
    node->c = std::move(c);
    node->late = late;
    torch::autograd::set_history(res[0], node);
  }
  return res;
}

bool layout_dying(const BankLayout& layout, const std::vector<Tensor>& gates,
                  const std::vector<Tensor>& alive) {
  layout.check(gates, alive);
  return any_dying(gates, alive, layout.bonds, layout.taus);
}

}  // namespace comera
