// AdamW over every parameter group of an optimizer in one call (comera_engine/ops/adamw.py;
// the reference is torch.optim.AdamW). A TT model has hundreds of small parameters, and
// torch's CPU step runs its fused kernel once per tensor and its Python once per group:
// at the sizes of a small model that costs more than the update (each parameter here is a
// plain loop).
//
// Per parameter of group g (hyper[5g..5g+4] = lr, beta1, beta2, weight decay, eps), with
// its step count t (a float32 scalar, incremented here):
//   p ← p − lr·wd·p;  m ← m + (1−β1)(grad − m);  v ← β2·v + (1−β2)·grad²;
//   p ← p − lr/(1−β1^t) · m / (√v / √(1−β2^t) + eps).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "tt_common.h"

namespace comera {

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least

// The update of n entries (a function of its own: the restrict pointers let the loop
// vectorize, which they do not through a lambda's captures).
template <typename T, bool kDecay>
void update(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
            T* __restrict__ v, int64_t n, T decay, T a1, T b2, T a2, T ss, T bc, T e) {
  for (int64_t j = 0; j < n; ++j) {
    const T pj = kDecay ? p[j] - decay * p[j] : p[j];
    const T gj = g[j];
    const T mj = m[j] + a1 * (gj - m[j]);
    const T vj = b2 * v[j] + a2 * gj * gj;
    m[j] = mj;
    v[j] = vj;
    p[j] = pj - ss * mj / (std::sqrt(vj) / bc + e);
  }
}

bool fits(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
          const Tensor& t) {
  const auto dt = p.scalar_type();
  auto same = [&](const Tensor& x) {
    return x.defined() && x.is_cpu() && x.layout() == at::kStrided && x.is_contiguous() &&
           x.scalar_type() == dt && x.sizes() == p.sizes();
  };
  return (dt == at::kFloat || dt == at::kDouble) && same(p) && same(g) && same(m) &&
         same(v) && t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat &&
         t.numel() == 1 && !p.is_same(g);
}

}  // namespace

bool adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                const std::vector<Tensor>& steps, const std::vector<int64_t>& counts,
                const std::vector<double>& hyper) {
  // everything checked before anything is written: false leaves all as it was
  const size_t n = params.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n ||
      steps.size() != n || hyper.size() != 5 * counts.size()) {
    return false;
  }
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total != static_cast<int64_t>(n)) return false;
  for (size_t i = 0; i < n; ++i) {
    if (!fits(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i])) return false;
  }
  size_t i = 0;
  for (size_t grp = 0; grp < counts.size(); ++grp) {
    const double lr = hyper[5 * grp], beta1 = hyper[5 * grp + 1], beta2 = hyper[5 * grp + 2];
    const double wd = hyper[5 * grp + 3], eps = hyper[5 * grp + 4];
    for (int64_t k = 0; k < counts[grp]; ++k, ++i) {
      float* pt = steps[i].data_ptr<float>();
      *pt += 1.0f;
      const double t = static_cast<double>(*pt);
      const double step_size = lr / (1.0 - std::pow(beta1, t));
      const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, t));
      AT_DISPATCH_FLOATING_TYPES(params[i].scalar_type(), "adamw_step", [&] {
        using T = scalar_t;
        T* p = params[i].data_ptr<T>();
        const T* g = grads[i].data_ptr<T>();
        T* m = exp_avgs[i].data_ptr<T>();
        T* v = exp_avg_sqs[i].data_ptr<T>();
        const T decay = static_cast<T>(lr * wd), a1 = static_cast<T>(1.0 - beta1);
        const T b2 = static_cast<T>(beta2), a2 = static_cast<T>(1.0 - beta2);
        const T ss = static_cast<T>(step_size), bc = static_cast<T>(bc2_sqrt);
        const T e = static_cast<T>(eps);
        // a large parameter is split over the threads (a small one runs inline)
        at::parallel_for(0, params[i].numel(), kGrain, [&](int64_t lo, int64_t hi) {
          if (decay != T(0)) {
            update<T, true>(p + lo, g + lo, m + lo, v + lo, hi - lo, decay, a1, b2, a2, ss,
                            bc, e);
          } else {
            update<T, false>(p + lo, g + lo, m + lo, v + lo, hi - lo, decay, a1, b2, a2, ss,
                             bc, e);
          }
        });
      });
    }
  }
  return true;
}

}  // namespace comera
