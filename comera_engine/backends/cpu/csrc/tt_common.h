// Shared by the native TT-linear ops (tt_sweep.cpp, tt_halves.cpp); see comera_engine/ops for
// the math they mirror.
//
// Layout: cores G_k (r_{k-1}, s_k, r_k), k < 2d; gates g_b for the 2d-1 bonds, bond b
// absorbed on the right of core b for b < d and on the left of core b+1 otherwise; masks
// alive_b & (|g_b| > tau) computed in one flat pass.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <vector>

namespace comera {

using at::Tensor;

// Where a bond's gate is absorbed: into core `core`, on its right bond or its left one.
struct GateSite {
  int64_t core;
  bool right;
};

// A TT-linear train of 2d cores: bond b on the right of core b for b < d, else on the
// left of core b+1 (the outer, smaller core of the two).
std::vector<GateSite> halves_sites(int64_t d);
// A train of K cores with every bond on the right of its left core (the TT matrix).
std::vector<GateSite> right_sites(int64_t K);

// A new CPU tensor as at::empty makes it, without going through the dispatcher: right
// after a model's forward every dispatch costs several times its own work, and the
// rank gates' small outputs are made then.
inline Tensor cpu_empty(at::IntArrayRef size, at::ScalarType dtype) {
  return Tensor(at::detail::empty_cpu(size, dtype));
}

inline Tensor left_mat(const Tensor& G) { return G.reshape({-1, G.size(-1)}); }   // (r0·n, r1)
inline Tensor right_mat(const Tensor& G) { return G.reshape({G.size(0), -1}); }  // (r0, n·r1)

// The gated cores (the raw ones where there are no gates); sets gm (the masked gate
// values, flat) and m (their mask) when gated, else leaves them undefined.
// aᵀ as a new contiguous tensor (a: 2-D): up to 2^17 elements a tiled loop on one
// thread, several times faster than ATen's strided copy for the small batch-by-feature
// matrices of a sweep; larger ones through ATen.
Tensor transposed(const Tensor& a);

std::vector<Tensor> absorb_gates(const std::vector<Tensor>& cores,
                                 const std::vector<Tensor>& gates,
                                 const std::vector<Tensor>& alive, double tau,
                                 const std::vector<GateSite>& sites, Tensor& gm, Tensor& m);

// From gradients of the gated cores d_eff to [d_raw_0.., d_gate_0..] (the raw cores'
// and, when gated, the gates' at `sites`; undefined where not asked for).
std::vector<Tensor> gate_grads(const std::vector<Tensor>& d_eff,
                               const std::vector<Tensor>& raw, const Tensor& gm,
                               const Tensor& m, const std::vector<GateSite>& sites,
                               bool need_cores, bool need_gates);

// The left merge chain of cores[0..n): prefixes P_k = G_0⋯G_k as (∏ modes, r_{k+1})
// matrices, [P_0, …, P_{n-1}]; and back from the last prefix's gradient dP to the
// gradients of cores[0..n) (P: the prefixes, the last one not needed).
std::vector<Tensor> merge_left(const std::vector<Tensor>& cores, int64_t n);
std::vector<Tensor> merge_left_grads(Tensor dP, const std::vector<Tensor>& cores,
                                     const std::vector<Tensor>& P, int64_t n);

// The sweep path (TTLinearSweep).
std::vector<Tensor> sweep_forward(const Tensor& x, const std::vector<Tensor>& cores,
                                  const std::vector<Tensor>& gates,
                                  const std::vector<Tensor>& alive, double tau,
                                  const c10::optional<Tensor>& bias, int64_t d, bool head,
                                  bool tail);
std::vector<Tensor> sweep_backward(const Tensor& dy, const std::vector<Tensor>& raw,
                                   const std::vector<Tensor>& eff,
                                   const std::vector<Tensor>& mats,
                                   const std::vector<Tensor>& ins,
                                   const c10::optional<Tensor>& gm_opt,
                                   const c10::optional<Tensor>& m_opt, int64_t d, int64_t nl,
                                   bool head, bool tail, bool need_x, bool need_bias,
                                   bool need_cores, bool need_gates);

// The halves path's batch-independent parts (TTLinearHalves; its batch GEMMs are chosen
// in Python: one by one in the install's ways (backends/cpu/gemm.py), or row-blocked below).
std::vector<Tensor> halves_prepare(const std::vector<Tensor>& cores,
                                   const std::vector<Tensor>& gates,
                                   const std::vector<Tensor>& alive, double tau,
                                   const c10::optional<Tensor>& bias, int64_t d,
                                   int64_t rp);
std::vector<Tensor> halves_core_grads(const Tensor& dL, const Tensor& dR,
                                      const std::vector<Tensor>& raw,
                                      const std::vector<Tensor>& eff,
                                      const std::vector<Tensor>& P,
                                      const std::vector<Tensor>& Q,
                                      const c10::optional<Tensor>& gm_opt,
                                      const c10::optional<Tensor>& m_opt, int64_t d,
                                      bool need_cores, bool need_gates);

// The halves path's batch GEMMs, row-blocked (tt_halves_batch.cpp): forward returns
// [y, XL]; backward [dx, dL (N, rp), dR (rp, M), dXL] (dx undefined unless need_x, dL and
// dR unless need_w).
std::vector<Tensor> halves_batch_forward(const Tensor& x, const Tensor& Lp, const Tensor& Rp,
                                         int64_t ones_col, int64_t block);
// Whether the blocked step calls BLAS (sgemm_) directly rather than through ATen; use 0
// or 1 sets it (the ATen path is the fallback where sgemm_ is not linked), -1 only asks.
bool halves_batch_blas(int64_t use);
std::vector<Tensor> halves_batch_backward(const Tensor& dy, const Tensor& x,
                                          const Tensor& XL, const Tensor& Lp,
                                          const Tensor& Rp, bool need_x, bool need_w,
                                          int64_t block);

// A gated TT matrix's W (N, M) as one autograd node ({W}), and a step's gradient clipping
// over all its gradients (ttm_matrix.cpp).
std::vector<Tensor> ttm_matrix(const std::vector<Tensor>& cores,
                               const std::vector<Tensor>& gates,
                               const std::vector<Tensor>& alive, double tau);
Tensor clip_grad_norm(const std::vector<Tensor>& grads, double max_norm);

// AdamW over every parameter group in one call (adamw.cpp): counts[g] parameters of group
// g in order, hyper[5g..5g+4] its lr, beta1, beta2, weight decay, eps. False (nothing
// written) where some tensor is not what it takes.
bool adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                const std::vector<Tensor>& steps, const std::vector<int64_t>& counts,
                const std::vector<double>& hyper);

}  // namespace comera
