// CPU kernel of meshkern_C::sym_eig_jacobi: one cyclic Jacobi solve per matrix (in
// double, whatever the input dtype; at most `sweeps` sweeps, fewer once converged),
// matrices spread over ATen's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "jacobi.h"

namespace {

std::tuple<at::Tensor, at::Tensor> sym_eig_jacobi_cpu(const at::Tensor& A_in, int64_t sweeps) {
  TORCH_CHECK(A_in.dim() == 3 && A_in.size(1) == A_in.size(2), "sym_eig_jacobi: A must be [B, k, k], got ",
              A_in.sizes());
  TORCH_CHECK(A_in.scalar_type() == at::kFloat || A_in.scalar_type() == at::kDouble,
              "sym_eig_jacobi: A must be float32 or float64, got ", A_in.scalar_type());
  TORCH_CHECK(sweeps >= 1, "sym_eig_jacobi: sweeps must be >= 1, got ", sweeps);
  const at::Tensor A = A_in.contiguous();
  const int64_t B = A.size(0), k = A.size(1);
  at::Tensor w = at::empty({B, k}, A.options());
  at::Tensor W = at::empty({B, k, k}, A.options());
  // fp32 results need ~1e-7 relative accuracy; 1e-9 leaves a margin for the rotations'
  // accumulated rounding. fp64 results: the double-precision floor.
  const double rel_tol = A.scalar_type() == at::kFloat ? 1e-9 : 1e-15;
  AT_DISPATCH_FLOATING_TYPES(A.scalar_type(), "sym_eig_jacobi_cpu", [&] {
    const scalar_t* a = A.data_ptr<scalar_t>();
    scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* Wp = W.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<double> M(k * k), V, ev;
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* ab = a + b * k * k;
        for (int64_t i = 0; i < k; ++i)  // read the symmetric part only
          for (int64_t j = 0; j < k; ++j) M[i * k + j] = 0.5 * (double(ab[i * k + j]) + double(ab[j * k + i]));
        meshkern_spectral::jacobi_eig(M, V, ev, k, sweeps, rel_tol);
        for (int64_t i = 0; i < k; ++i) wp[b * k + i] = static_cast<scalar_t>(ev[i]);
        for (int64_t i = 0; i < k; ++i)  // V holds the eigenvectors as rows: W = V^T
          for (int64_t j = 0; j < k; ++j) Wp[b * k * k + i * k + j] = static_cast<scalar_t>(V[j * k + i]);
      }
    });
  });
  return {w, W};
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) { m.impl("sym_eig_jacobi", &sym_eig_jacobi_cpu); }
