// meshkern_C::gram_products, the CPU kernel of randomized_svd(method="krylov"): for each
// matrix A[m, n] of a batch and a block of b Krylov vectors (rows Vt[b, n]) it computes
//   Y = A V          ([m, b], returned as rows Yt[b, m])
//   Z = A^T Y        ([n, b], returned as rows Zt[b, n]; skipped when with_z is false)
// in ONE pass over A. Why a kernel: the block Lanczos iteration needs a product with A
// and one with A^T per step at a narrow width (b = 16 at rank 32), where MKL runs at
// 45-60 GFLOP/s on one core (the packed GEMM path is built for wide right-hand sides),
// and streams A from memory twice per step. The row panels (row_panel.h) read each panel
// of A once from memory for both products:
//   measured 92-104 GFLOP/s on one AMD EPYC (Zen 4) core with AVX-512 and 80-90 with AVX2,
//   16 x [1024, 1024] fp32, b = 16 (docs/benchmarks.md, "Spectral").
// gram_products_supported(b) says whether this CPU and b have a kernel, and
// meshkern.spectral falls back to two torch GEMMs otherwise.
// Each matrix is computed by one thread (at::parallel_for over the batch) in a fixed
// order, so the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "row_panel.h"

namespace meshkern {
namespace krylov {
namespace {

using row_panel::MatrixFn;
MatrixFn pick(int64_t b) { return row_panel::pick_row_panels(b); }

bool gram_products_supported(int64_t b) { return pick(b) != nullptr; }

// Rows [b, len] of batch entry e of a tensor whose last dim is contiguous and rows are
// `len` apart (a slice along dim 1 of a bigger [B, *, len] buffer qualifies).
bool rows_dense(const at::Tensor& t, int64_t len) { return t.stride(2) == 1 && t.stride(1) == len; }

template <typename OutT>
void run_batch(const at::Tensor& A, const at::Tensor& Vt, at::Tensor& Yt, at::Tensor& Zt, bool with_z, MatrixFn fn) {
  const int64_t B = A.size(0), m = A.size(1), n = A.size(2), b = Vt.size(1);
  const float* a = A.const_data_ptr<float>();
  const float* vt = Vt.const_data_ptr<float>();
  OutT* yt = Yt.data_ptr<OutT>();
  float* zt = with_z ? Zt.data_ptr<float>() : nullptr;
  const int64_t vs = Vt.stride(0), ys = Yt.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> V(n * b), Y(m * b), Z(with_z ? n * b : 0);
    for (int64_t e = begin; e < end; ++e) {
      const float* vte = vt + e * vs;
      for (int64_t q = 0; q < b; ++q)
        for (int64_t k = 0; k < n; ++k) V[k * b + q] = vte[q * n + k];
      if (with_z) std::memset(Z.data(), 0, Z.size() * sizeof(float));
      fn(a + e * m * n, m, n, V.data(), Y.data(), with_z ? Z.data() : nullptr);
      OutT* yte = yt + e * ys;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t q = 0; q < b; ++q) yte[q * m + i] = static_cast<OutT>(Y[i * b + q]);
      if (with_z) {
        float* zte = zt + e * b * n;
        for (int64_t k = 0; k < n; ++k)
          for (int64_t q = 0; q < b; ++q) zte[q * n + k] = Z[k * b + q];
      }
    }
  });
}

at::Tensor gram_products(const at::Tensor& A, const at::Tensor& Vt, bool with_z, at::Tensor& Yt) {
  TORCH_CHECK(A.dim() == 3 && A.scalar_type() == at::kFloat && A.is_contiguous(),
              "gram_products: A must be a contiguous fp32 [B, m, n] tensor");
  const int64_t B = A.size(0), m = A.size(1), n = A.size(2);
  TORCH_CHECK(Vt.dim() == 3 && Vt.size(0) == B && Vt.size(2) == n && Vt.scalar_type() == at::kFloat &&
                  rows_dense(Vt, n),
              "gram_products: Vt must be fp32 [B, b, n] with dense rows, got ", Vt.sizes(), " strides ", Vt.strides());
  const int64_t b = Vt.size(1);
  TORCH_CHECK(Yt.dim() == 3 && Yt.size(0) == B && Yt.size(1) == b && Yt.size(2) == m && rows_dense(Yt, m) &&
                  (Yt.scalar_type() == at::kFloat || Yt.scalar_type() == at::kDouble),
              "gram_products: Yt must be fp32/fp64 [B, b, m] with dense rows, got ", Yt.sizes());
  const MatrixFn fn = pick(b);
  TORCH_CHECK(fn != nullptr, "gram_products: no kernel for block size ", b,
              " on this CPU (see gram_products_supported)");
  at::Tensor Zt = with_z ? at::empty({B, b, n}, A.options()) : at::empty({0}, A.options());
  if (Yt.scalar_type() == at::kDouble) {
    run_batch<double>(A, Vt, Yt, Zt, with_z, fn);
  } else {
    run_batch<float>(A, Vt, Yt, Zt, with_z, fn);
  }
  return Zt;
}

}  // namespace
}  // namespace krylov
}  // namespace meshkern

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  // Writes Yt = (A V)^T (fp32 or fp64: the Ritz step wants fp64) and returns Zt = (A^T A V)^T
  // (fp32; an empty tensor when with_z is false) for A[B, m, n] and rows Vt[B, b, n] (fp32,
  // CPU), one pass over A per matrix. Vt and Yt may be slices along dim 1 of bigger buffers
  // (dense rows, any batch stride).
  m.def("gram_products(Tensor A, Tensor Vt, bool with_z, Tensor(a!) Yt) -> Tensor");
  // Whether this CPU has a gram_products kernel for block size b.
  m.def("gram_products_supported(int b) -> bool", &meshkern::krylov::gram_products_supported);
}

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) { m.impl("gram_products", &meshkern::krylov::gram_products); }
