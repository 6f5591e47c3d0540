// Python module init for meshkern._pca_C and the schemas of its internal ops.
// Kernels: pca_cpu.cpp (CPU). The public ops (meshkern::pca_encode / pca_decode, with
// checks and fake kernels) live in meshkern/pca.py and call these. Rows go through a row
// map (rb, rs, r0): kernel row i is memory row (i / rb) * rs + i % rb + r0, so the sink
// layout's body rows x[..., 1:, :] are read and written in place.
#include <torch/library.h>

#include "pymodule.h"

MESHKERN_PYMODULE(_pca_C)

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  // c[N, k] fp32 = ((x[rows] - mean) @ U) / norm; x [*, H] any float dtype, U [H, k],
  // mean [H] (optional), norm [k], all fp32.
  m.def("pca_project(Tensor x, int N, int[] rowmap, Tensor? mean, Tensor U, Tensor norm) -> Tensor");
  // Per-row absmax quantization of the N rows [W] of src: codes [N, W] int8 (bits 8) or
  // [N, ceil(W/2)] uint8 (bits 4, low nibble = even column, value + 8), scales [N] fp32.
  m.def("pca_quantize_rows(Tensor src, int N, int W, int[] rowmap, int bits) -> (Tensor, Tensor)");
  // out[rows] = ((q * scale) * norm) @ U^T (+ mean), cast to out's dtype.
  m.def("pca_decode(Tensor q, Tensor scale, Tensor norm, Tensor U, Tensor? mean, Tensor(a!) out, int N, "
        "int[] rowmap, int bits) -> ()");
}
