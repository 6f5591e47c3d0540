// Python module init for meshkern._spectral_C and the schemas of its internal ops.
// Kernels: jacobi.cpp (CPU), project.cpp (CPU + CUDA through ATen), jacobi_cuda.cu (CUDA).
#include <torch/library.h>

#include "pymodule.h"

MESHKERN_PYMODULE(_spectral_C)

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  // Eigenpairs of a batch of small symmetric matrices A[B,k,k] (fp32/fp64), unsorted:
  // (w[B,k], W[B,k,k]) with A = W diag(w) W^T. meshkern.spectral sorts them.
  m.def("sym_eig_jacobi(Tensor A, int sweeps) -> (Tensor, Tensor)");
  // Writes alpha*G + (1-alpha) U diag(d) (U^T G V) diag(d) V^T, d = S/(S+tau), into `out`
  // (contiguous, G's shape/dtype/device) and returns ||diag(d) U^T G V diag(d)||_F^2 per
  // batch entry (= ||G_filt||_F^2 for orthonormal U, V). The only projection kernel: the
  // allocating public op allocates `out` and calls it.
  m.def("spectral_project_out(Tensor G, Tensor U, Tensor S, Tensor V, float tau, float alpha, Tensor(a!) out) "
        "-> Tensor");
}
