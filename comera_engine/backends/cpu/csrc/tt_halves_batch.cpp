// The halves path's six batch GEMMs (TTLinearHalves, ops/tt_linear_halves.py), row-blocked: the
// batch is cut into blocks of rows, each thread takes a contiguous run of blocks and
// runs every product of the step on one block after the other with single-threaded
// BLAS while the block is in its L2 cache; the sums over the batch (dR, dL) go into
// per-thread partials, added up at the end in thread order (so a run is reproducible
// for a given thread count). Against the same six products called one by one, each
// split over all threads by the BLAS library, this reads every batch tensor from memory
// once per phase instead of once per product (docs/BENCHMARKS.md). fp32 only; the
// caller (gemm.py's per-machine choice) decides where it runs.
//
// Shapes: x (B, N), Lp (N, rp), Rp (rp, M), XL (B, rp), dy (B, M).
#include "tt_common.h"

#include <ATen/Parallel.h>

// Fortran BLAS as linked into libtorch_cpu (MKL on x86 builds), weak: a build without it
// leaves these null and the ATen path below runs instead.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b,
            const int* ldb, const float* beta, float* c, const int* ldc)
    __attribute__((weak));
}

namespace comera {

namespace {

bool g_blas_direct = true;  // off: the ATen path even where sgemm_ is linked (tests)

// Row-major C (m×n, ldc) = op(A)·op(B) + beta·C, op(A) (m×k), op(B) (k×n); ta/tb: the
// stored matrix is the transpose. BLAS is column-major: C^T = op(B)^T·op(A)^T.
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A,
             int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (g_blas_direct && sgemm_ != nullptr) {
    const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
    const float one = 1.0f;
    sgemm_(&b, &a, &M, &N, &K, &one, B, &LA, A, &LB, &beta, C, &LC);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  const Tensor a = at::from_blob(const_cast<float*>(A), {ta ? k : m, ta ? m : k}, {lda, 1}, opts);
  const Tensor b = at::from_blob(const_cast<float*>(B), {tb ? n : k, tb ? k : n}, {ldb, 1}, opts);
  Tensor c = at::from_blob(C, {m, n}, {ldc, 1}, opts);
  if (beta == 0.0f) {
    at::mm_out(c, ta ? a.t() : a, tb ? b.t() : b);
  } else {
    c.addmm_(ta ? a.t() : a, tb ? b.t() : b);
  }
}

void check(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.is_contiguous(),
              name, ": expected a contiguous 2-D float32 CPU tensor");
}

}  // namespace

bool halves_batch_blas(int64_t use) {
  if (use >= 0) g_blas_direct = use != 0;
  return g_blas_direct && sgemm_ != nullptr;
}

std::vector<Tensor> halves_batch_forward(const Tensor& x, const Tensor& Lp, const Tensor& Rp,
                                         int64_t ones_col, int64_t block) {
  at::AutoDispatchBelowADInplaceOrView guard;
  check(x, "x");
  const Tensor L = Lp.contiguous(), R = Rp.contiguous();
  const int64_t B = x.size(0), N = x.size(1), rp = L.size(1), M = R.size(1);
  Tensor XL = at::empty({B, rp}, x.options());
  Tensor y = at::empty({B, M}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pL = L.data_ptr<float>();
  const float* pR = R.data_ptr<float>();
  float* pXL = XL.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t nb = (B + block - 1) / block;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = b * block, n = std::min(block, B - s);
      gemm_rm(false, false, n, rp, N, px + s * N, N, pL, rp, 0.0f, pXL + s * rp, rp);
      if (ones_col >= 0) {  // meets the bias row of Rp
        for (int64_t i = 0; i < n; ++i) pXL[(s + i) * rp + ones_col] = 1.0f;
      }
      gemm_rm(false, false, n, M, rp, pXL + s * rp, rp, pR, M, 0.0f, py + s * M, M);
    }
  });
  return {y, XL};
}

std::vector<Tensor> halves_batch_backward(const Tensor& dy_in, const Tensor& x,
                                          const Tensor& XL, const Tensor& Lp,
                                          const Tensor& Rp, bool need_x, bool need_w,
                                          int64_t block) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const Tensor dy = dy_in.contiguous();
  check(dy, "dy");
  check(x, "x");
  check(XL, "XL");
  const Tensor L = Lp.contiguous(), R = Rp.contiguous();
  const int64_t B = x.size(0), N = x.size(1), rp = L.size(1), M = R.size(1);
  Tensor dXL = at::empty({B, rp}, x.options());
  Tensor dx = need_x ? at::empty({B, N}, x.options()) : Tensor();
  const int64_t nb = (B + block - 1) / block;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nb));
  // per-thread partials: dR (rp, M) and dLᵀ (rp, N), the wide side contiguous
  Tensor dRs = need_w ? at::zeros({nt, rp, M}, x.options()) : Tensor();
  Tensor dLs = need_w ? at::zeros({nt, rp, N}, x.options()) : Tensor();
  const float* pdy = dy.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* pXL = XL.data_ptr<float>();
  const float* pL = L.data_ptr<float>();
  const float* pR = R.data_ptr<float>();
  float* pg = dXL.data_ptr<float>();
  float* pdx = need_x ? dx.data_ptr<float>() : nullptr;
  // one contiguous run of blocks per thread: partial t holds the blocks of run t
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dR = need_w ? dRs.data_ptr<float>() + t * rp * M : nullptr;
      float* dLt = need_w ? dLs.data_ptr<float>() + t * rp * N : nullptr;
      for (int64_t b = nb * t / nt; b < nb * (t + 1) / nt; ++b) {
        const int64_t s = b * block, n = std::min(block, B - s);
        const float* dyb = pdy + s * M;
        float* g = pg + s * rp;
        gemm_rm(false, true, n, rp, M, dyb, M, pR, M, 0.0f, g, rp);  // dXL = dY·Rᵀ
        if (need_w) {  // dR += XLᵀ·dY, while dY's block is in cache
          gemm_rm(true, false, rp, M, n, pXL + s * rp, rp, dyb, M, 1.0f, dR, M);
        }
        if (need_x) {  // dX = dXL·Lᵀ
          gemm_rm(false, true, n, N, rp, g, rp, pL, rp, 0.0f, pdx + s * N, N);
        }
        if (need_w) {  // dLᵀ += dXLᵀ·X
          gemm_rm(true, false, rp, N, n, g, rp, px + s * N, N, 1.0f, dLt, N);
        }
      }
    }
  });
  Tensor dL, dR;
  if (need_w) {
    dR = dRs[0];
    Tensor dLt = dLs[0];
    for (int64_t t = 1; t < nt; ++t) {
      dR.add_(dRs[t]);
      dLt.add_(dLs[t]);
    }
    dL = dLt.t();  // (N, rp), a transposed view
  }
  return {dx, dL, dR, dXL};
}

}  // namespace comera
