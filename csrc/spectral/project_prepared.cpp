// meshkern_C::project_prepared, the fast node's per-step projection on CPU: for every
// filtered matrix G[m, n] of a step, with the prior prepared once per arrival
// (U [m, r]; Udt = (U diag(d))^T [r, m]; Vd = V diag(d) [n, r]; Vt = V^T [r, n]),
//   Xf  = Udt (G Vd)                        [r, r]
//   W   = (1 - alpha) U Xf                  [m, r]
//   out = alpha G + W Vt                    [m, n]   one pass over G and out
// and returns the Xf (||G_filt||_F^2 = ||Xf||_F^2 for orthonormal U, V). The three narrow
// products run in row panels (row_panel.h) where this CPU has them for r, else in BLAS.
//
// Why a kernel: the reference chain (meshkern.spectral.project_prepared_reference) ends in
// torch.addmm(G, W, Vt, beta=alpha, out=out), which on CPU copies G into out and then runs
// a beta != 0 GEMM over it: three passes over an m x n matrix where this loop makes one
// (read G, write out). And one call per step for all matrices instead of four torch
// calls per matrix: on small matrices BLAS's per-call cost was of the order of the
// arithmetic. Measured in bench/anchor_step_bench.py (docs/benchmarks.md, "The fast
// node's optimizer with the factored transport").
//
// Arithmetic of one element of out, in this order on every ISA variant and in the scalar
// tail: acc = 0; for k in 0..r: acc = fma(W[i, k], Vt[k, j], acc); out = fma(alpha, G[i, j], acc)
// so it does not depend on the vector width, the tile position or the thread count. The
// low-rank sum is accumulated on its own and alpha G added last, in one rounding: adding
// into alpha G from the start rounded r times at G's magnitude (3x the max error of the
// torch chain in our check; this order's error is below the chain's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "row_panel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace meshkern {
namespace project_prepared {
namespace {

// Rows [i0, i1) of out, all columns, in scalar code (the tails and the generic build).
void rows_scalar(const float* G, const float* W, const float* Vt, float alpha, float* out, int64_t n, int64_t r,
                 int64_t i0, int64_t i1, int64_t j0) {
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = j0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < r; ++k) acc = std::fma(W[i * r + k], Vt[k * n + j], acc);
      out[i * n + j] = std::fma(alpha, G[i * n + j], acc);
    }
  }
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MESHKERN_AXPBY_SIMD 1

// A tile of R rows x C vectors of out: R * C accumulators in registers; per k, C loads of
// Vt's row and R broadcasts of W, R * C fused multiply-adds. Intrinsics, not GCC vector
// arithmetic, whose a * b + c the compiler may or may not contract into one FMA: the scalar
// tail (std::fma) must do exactly what the vectors do.
#define MESHKERN_AXPBY_TILE_BODY(VEC, LOADU, STOREU, SET1, ZERO, FMADD, VL)                 \
  VEC acc[R][C];                                                                             \
  const VEC va = SET1(alpha);                                                                \
  for (int a = 0; a < R; ++a)                                                                \
    for (int c = 0; c < C; ++c) acc[a][c] = ZERO();                                          \
  for (int64_t k = 0; k < r; ++k) {                                                          \
    VEC v[C];                                                                                \
    for (int c = 0; c < C; ++c) v[c] = LOADU(Vt + k * n + j + c * VL);                       \
    for (int a = 0; a < R; ++a) {                                                            \
      const VEC s = SET1(W[a * r + k]);                                                      \
      for (int c = 0; c < C; ++c) acc[a][c] = FMADD(s, v[c], acc[a][c]);                     \
    }                                                                                        \
  }                                                                                          \
  for (int a = 0; a < R; ++a)                                                                \
    for (int c = 0; c < C; ++c) STOREU(out + a * n + j + c * VL, FMADD(va, LOADU(G + a * n + j + c * VL), acc[a][c]));

template <int R, int C>
__attribute__((target("avx512f"))) void tile_avx512(const float* G, const float* W, const float* Vt, float alpha,
                                                    float* out, int64_t n, int64_t r, int64_t j) {
  MESHKERN_AXPBY_TILE_BODY(__m512, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_setzero_ps,
                           _mm512_fmadd_ps, 16)
}

template <int R, int C>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* G, const float* W, const float* Vt, float alpha,
                                                  float* out, int64_t n, int64_t r, int64_t j) {
  MESHKERN_AXPBY_TILE_BODY(__m256, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_setzero_ps,
                           _mm256_fmadd_ps, 8)
}
#undef MESHKERN_AXPBY_TILE_BODY

// R rows starting at row i: full tiles of C vectors, then single vectors, then scalars.
template <int VL, int R, int C, bool kAvx512>
void row_block(const float* G, const float* W, const float* Vt, float alpha, float* out, int64_t n, int64_t r,
               int64_t i) {
  const float* g = G + i * n;
  const float* w = W + i * r;
  float* o = out + i * n;
  int64_t j = 0;
  for (; j + VL * C <= n; j += VL * C) {
    if constexpr (kAvx512) tile_avx512<R, C>(g, w, Vt, alpha, o, n, r, j);
    else tile_avx2<R, C>(g, w, Vt, alpha, o, n, r, j);
  }
  for (; j + VL <= n; j += VL) {
    if constexpr (kAvx512) tile_avx512<R, 1>(g, w, Vt, alpha, o, n, r, j);
    else tile_avx2<R, 1>(g, w, Vt, alpha, o, n, r, j);
  }
  if (j < n) rows_scalar(G, W, Vt, alpha, out, n, r, i, i + R, j);
}

// Register budget: R * C accumulators + C of Vt + a broadcast, of 32 zmm / 16 ymm.
template <int VL, int R, int C, bool kAvx512>
void matrix_simd(const float* G, const float* W, const float* Vt, float alpha, float* out, int64_t m, int64_t n,
                 int64_t r) {
  int64_t i = 0;
  for (; i + R <= m; i += R) row_block<VL, R, C, kAvx512>(G, W, Vt, alpha, out, n, r, i);
  for (; i < m; ++i) row_block<VL, 1, C, kAvx512>(G, W, Vt, alpha, out, n, r, i);
}
#endif

void axpby_one(const float* G, const float* W, const float* Vt, float alpha, float* out, int64_t m, int64_t n,
               int64_t r) {
#ifdef MESHKERN_AXPBY_SIMD
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512) return matrix_simd<16, 4, 4, true>(G, W, Vt, alpha, out, m, n, r);
  if (avx2) return matrix_simd<8, 2, 4, false>(G, W, Vt, alpha, out, m, n, r);
#endif
  rows_scalar(G, W, Vt, alpha, out, n, r, 0, m, 0);
}

void check_entry(size_t e, const at::Tensor& G, const at::Tensor& U, const at::Tensor& Udt, const at::Tensor& Vd,
                 const at::Tensor& Vt, const at::Tensor& out) {
  auto fp32_cpu = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous();
  };
  TORCH_CHECK(G.dim() == 2 && fp32_cpu(G), "project_prepared: G[", e, "] must be a contiguous fp32 CPU matrix, got ",
              G.sizes(), " ", G.scalar_type(), " ", G.device());
  const int64_t m = G.size(0), n = G.size(1);
  TORCH_CHECK(U.dim() == 2 && U.size(0) == m && fp32_cpu(U), "project_prepared: U[", e, "] must be contiguous fp32 [",
              m, ", r], got ", U.sizes());
  const int64_t r = U.size(1);
  TORCH_CHECK(Udt.dim() == 2 && Udt.size(0) == r && Udt.size(1) == m && fp32_cpu(Udt), "project_prepared: Udt[", e,
              "] must be contiguous fp32 [", r, ", ", m, "], got ", Udt.sizes());
  TORCH_CHECK(Vd.dim() == 2 && Vd.size(0) == n && Vd.size(1) == r && fp32_cpu(Vd), "project_prepared: Vd[", e,
              "] must be contiguous fp32 [", n, ", ", r, "], got ", Vd.sizes());
  TORCH_CHECK(Vt.dim() == 2 && Vt.size(0) == r && Vt.size(1) == n && fp32_cpu(Vt), "project_prepared: Vt[", e,
              "] must be contiguous fp32 [", r, ", ", n, "], got ", Vt.sizes());
  TORCH_CHECK(out.sizes() == G.sizes() && fp32_cpu(out), "project_prepared: out[", e,
              "] must be contiguous fp32 with G's shape ", G.sizes(), ", got ", out.sizes());
  TORCH_CHECK(!out.is_same(G) && out.data_ptr() != G.data_ptr(), "project_prepared: out[", e, "] must not be G[", e,
              "]");
}

std::vector<at::Tensor> project_prepared(at::TensorList G, at::TensorList U, at::TensorList Udt, at::TensorList Vd,
                                         at::TensorList Vt, at::ArrayRef<double> alpha, at::TensorList out) {
  const size_t N = G.size();
  TORCH_CHECK(U.size() == N && Udt.size() == N && Vd.size() == N && Vt.size() == N && alpha.size() == N &&
                  out.size() == N,
              "project_prepared: every list must have one entry per matrix (", N, "), got U ", U.size(), ", Udt ",
              Udt.size(), ", Vd ", Vd.size(), ", Vt ", Vt.size(), ", alpha ", alpha.size(), ", out ", out.size());
  for (size_t e = 0; e < N; ++e) {
    check_entry(e, G[e], U[e], Udt[e], Vd[e], Vt[e], out[e]);
    TORCH_CHECK(alpha[e] >= 0.0 && alpha[e] <= 1.0, "project_prepared: alpha[", e, "] must lie in [0, 1], got ",
                alpha[e]);
  }
  std::vector<at::Tensor> Xf(N);
  for (size_t e = 0; e < N; ++e) {
    const int64_t m = G[e].size(0), n = G[e].size(1), r = U[e].size(1);
    const row_panel::MatrixFn panels = row_panel::pick_row_panels(r);
    at::Tensor W;
    if (panels != nullptr) {
      // All three narrow products in row panels: BLAS's per-call cost was of the order of
      // the arithmetic on small matrices (the default model's [192, 192]), three GEMMs per
      // matrix.
      const at::TensorOptions opt = G[e].options();
      at::Tensor GV = at::empty({m, r}, opt);
      panels(G[e].const_data_ptr<float>(), m, n, Vd[e].const_data_ptr<float>(), GV.data_ptr<float>(), nullptr);
      Xf[e] = at::empty({r, r}, opt);
      panels(Udt[e].const_data_ptr<float>(), r, m, GV.const_data_ptr<float>(), Xf[e].data_ptr<float>(), nullptr);
      const at::Tensor Xs = Xf[e] * (1.0 - alpha[e]);
      W = at::empty({m, r}, opt);
      panels(U[e].const_data_ptr<float>(), m, r, Xs.const_data_ptr<float>(), W.data_ptr<float>(), nullptr);
    } else {
      Xf[e] = at::mm(Udt[e], at::mm(G[e], Vd[e]));                      // [r, r]
      W = at::mm(U[e], Xf[e]).mul_(1.0 - alpha[e]);                     // [m, r], contiguous
    }
    const float* g = G[e].const_data_ptr<float>();
    const float* w = W.const_data_ptr<float>();
    const float* vt = Vt[e].const_data_ptr<float>();
    float* o = out[e].data_ptr<float>();
    const float a = static_cast<float>(alpha[e]);
    // Rows split over threads in blocks of 64: each element's arithmetic is fixed above,
    // so the result does not depend on the split.
    at::parallel_for(0, (m + 63) / 64, 1, [&](int64_t b0, int64_t b1) {
      const int64_t i0 = b0 * 64, i1 = std::min(m, b1 * 64);
      axpby_one(g + i0 * n, w + i0 * r, vt, a, o + i0 * n, i1 - i0, n, r);
    });
  }
  return Xf;
}

}  // namespace
}  // namespace project_prepared
}  // namespace meshkern

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  // For each matrix e: Xf = Udt (G Vd), out = alpha G + (1 - alpha) U Xf Vt (fp32, CPU,
  // contiguous; out must not be G); returns the Xf. meshkern.optim.SpectralAdamW's direct
  // path: the prior prepared once per arrival, every filtered matrix of a step in one call.
  m.def("project_prepared(Tensor[] G, Tensor[] U, Tensor[] Udt, Tensor[] Vd, Tensor[] Vt, float[] alpha, "
        "Tensor(a!)[] out) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("project_prepared", &meshkern::project_prepared::project_prepared);
}
