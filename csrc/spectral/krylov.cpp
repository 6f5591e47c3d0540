// meshkern_C::gram_products, the CPU kernel of randomized_svd(method="krylov"): for each
// matrix A[m, n] of a batch and a block of b Krylov vectors (rows Vt[b, n]) it computes
//   Y = A V          ([m, b], returned as rows Yt[b, m])
//   Z = A^T Y        ([n, b], returned as rows Zt[b, n]; skipped when with_z is false)
// in ONE pass over A. Why a kernel: the block Lanczos iteration needs a product with A
// and one with A^T per step at a narrow width (b = 16 at rank 32), where MKL runs at
// 45-60 GFLOP/s on one core (the packed GEMM path is built for wide right-hand sides),
// and streams A from memory twice per step. Here a panel of R rows of A (R * n * 4 bytes,
// L1/L2-resident) is read once for the R dot-product rows of Y (R x b accumulators held
// in vector registers) and once more, from cache, for the rank-R update of Z:
//   measured 92-104 GFLOP/s on one AMD EPYC (Zen 4) core with AVX-512 and 80-90 with AVX2,
//   16 x [1024, 1024] fp32, b = 16 (docs/benchmarks.md, "Spectral").
// Vector code: GCC/Clang vector extensions in functions compiled for avx512f or avx2+fma
// (target attributes; the rest of the extension keeps the default flags) and chosen at
// run time from the CPU's features. Supported: b a multiple of 16 up to 64 with AVX-512,
// b in {8, 16} with AVX2 (wider blocks spilled registers and ran at ~15 GFLOP/s there);
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

namespace meshkern {
namespace krylov {
namespace {

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MESHKERN_KRYLOV_SIMD 1

template <int VL>
struct VecOf;
template <>
struct VecOf<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct VecOf<8> {
  typedef float type __attribute__((vector_size(32)));
};

// Rows [0, R) of the panel A (row stride n): Y[r, :] = A[r, :] V, then Z += A[r, :]^T Y[r, :]
// for every column k. V, Y, Z are k-major ([n, b], [R, b], [n, b]); b = VL * NV.
#define MESHKERN_PANEL_BODY                                                                    \
  using Vec = typename VecOf<VL>::type;                                                        \
  constexpr int b = VL * NV;                                                                   \
  Vec acc[R][NV];                                                                              \
  for (int r = 0; r < R; ++r)                                                                  \
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec{};                                            \
  for (int64_t k = 0; k < n; ++k) {                                                            \
    Vec x[NV];                                                                                 \
    for (int v = 0; v < NV; ++v) std::memcpy(&x[v], V + k * b + v * VL, sizeof(Vec));          \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {                                     \
      const float s = A[r * n + k];                                                            \
      for (int v = 0; v < NV; ++v) acc[r][v] += s * x[v];                                      \
    }                                                                                          \
  }                                                                                            \
  for (int r = 0; r < R; ++r)                                                                  \
    for (int v = 0; v < NV; ++v) std::memcpy(Y + r * b + v * VL, &acc[r][v], sizeof(Vec));    \
  if (Z == nullptr) return;                                                                    \
  for (int64_t k = 0; k < n; ++k) {                                                            \
    Vec z[NV];                                                                                 \
    for (int v = 0; v < NV; ++v) std::memcpy(&z[v], Z + k * b + v * VL, sizeof(Vec));          \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {                                     \
      const float s = A[r * n + k];                                                            \
      for (int v = 0; v < NV; ++v) z[v] += s * acc[r][v];                                      \
    }                                                                                          \
    for (int v = 0; v < NV; ++v) std::memcpy(Z + k * b + v * VL, &z[v], sizeof(Vec));          \
  }

template <int VL, int NV, int R>
__attribute__((target("avx512f"))) void panel_avx512(const float* A, int64_t n, const float* V, float* Y,
                                                     float* Z) {
  MESHKERN_PANEL_BODY
}

template <int VL, int NV, int R>
__attribute__((target("avx2,fma"))) void panel_avx2(const float* A, int64_t n, const float* V, float* Y,
                                                   float* Z) {
  MESHKERN_PANEL_BODY
}
#undef MESHKERN_PANEL_BODY

using MatrixFn = void (*)(const float* A, int64_t m, int64_t n, const float* V, float* Y, float* Z);

// One matrix: panels of R rows, then the m % R last rows one at a time. Z must be zeroed.
template <int VL, int NV, int R, bool kAvx512>
void one_matrix(const float* A, int64_t m, int64_t n, const float* V, float* Y, float* Z) {
  constexpr int b = VL * NV;
  int64_t i = 0;
  for (; i + R <= m; i += R) {
    if constexpr (kAvx512) {
      panel_avx512<VL, NV, R>(A + i * n, n, V, Y + i * b, Z);
    } else {
      panel_avx2<VL, NV, R>(A + i * n, n, V, Y + i * b, Z);
    }
  }
  for (; i < m; ++i) {
    if constexpr (kAvx512) {
      panel_avx512<VL, NV, 1>(A + i * n, n, V, Y + i * b, Z);
    } else {
      panel_avx2<VL, NV, 1>(A + i * n, n, V, Y + i * b, Z);
    }
  }
}

// Register budget: R * NV accumulators (+ NV for V's row) of the 32 zmm / 16 ymm registers.
// R measured on Zen 4 (b = 16: R = 8 and 6 within 1%; b = 32: R = 8 best).
MatrixFn pick(int64_t b) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512) {
    switch (b) {
      case 16: return &one_matrix<16, 1, 8, true>;
      case 32: return &one_matrix<16, 2, 8, true>;
      case 48: return &one_matrix<16, 3, 6, true>;
      case 64: return &one_matrix<16, 4, 4, true>;
      default: break;
    }
  }
  if (avx2) {
    switch (b) {
      case 8: return &one_matrix<8, 1, 8, false>;
      case 16: return &one_matrix<8, 2, 6, false>;
      default: break;
    }
  }
  return nullptr;
}
#else
using MatrixFn = void (*)(const float*, int64_t, int64_t, const float*, float*, float*);
MatrixFn pick(int64_t) { return nullptr; }
#endif

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
