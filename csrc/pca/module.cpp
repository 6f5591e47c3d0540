// Python module init for meshkern._pca_C and the schemas of its internal ops.
// Kernels: pca_cpu.cpp (CPU; int4/int8), pca_nf_cpu.cpp (CPU; quant=nf's codes). The public ops (meshkern::pca_encode / pca_decode, with
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
  // quant=nf (meshkern/pca_nf.py): z [N, k] fp32 -> [N, nbytes] uint8, coordinate i's code =
  // the count of bounds[i, :2^bits_i - 1] below z[:, i] (NaN: all of them), bits_i wide, LSB
  // first; bits [k] int64 in 0..8, bounds [k, 2^max - 1] fp32.
  m.def("pca_nf_pack(Tensor z, Tensor bounds, Tensor bits, int nbytes) -> Tensor");
  // The inverse: [N, nbytes] uint8 -> z_hat [N, k] fp32 = levels[i, code_i] (0 where bits_i = 0).
  m.def("pca_nf_unpack(Tensor packed, Tensor levels, Tensor bits) -> Tensor");
}
