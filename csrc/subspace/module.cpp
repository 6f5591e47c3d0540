// Python module init for meshkern._subspace_C and the schemas of its internal ops.
// Kernels: subspace_cpu.cpp (CPU). The public ops (meshkern::subspace_encode/decode, with
// checks, fake kernels and autograd) live in meshkern/subspace.py and call these.
#include <torch/library.h>

#include "pymodule.h"

MESHKERN_PYMODULE(_subspace_C)

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  // c[N, k] = (h[N, H] - base) @ U[H, k]; base = E[ids] (ids [N] int64, E [V, H]), or
  // offset [H], or zero; or, with table [V, k] (= E @ U) instead of E, h @ U - table[ids].
  // Accumulates in fp32 (fp64 for fp64); result in h's dtype.
  m.def("subspace_encode(Tensor h, Tensor? ids, Tensor? E, Tensor? offset, Tensor? table, Tensor U) -> Tensor");
  // h[N, H] = base + c[N, k] @ U[H, k]^T, base as above; result in c's dtype.
  m.def("subspace_decode(Tensor c, Tensor? ids, Tensor? E, Tensor? offset, Tensor U) -> Tensor");
}
