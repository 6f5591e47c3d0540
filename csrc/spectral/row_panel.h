// Row panels of A[m, n] (row-major) times a narrow V[n, b] (k-major: row k of V is b
// contiguous floats), and optionally the rank-R update Z += A_panel^T Y back from the same
// panel, for the CPU kernels of the spectral group: meshkern_C::gram_products (krylov.cpp,
// Y and Z) and meshkern_C::project_prepared (project_prepared.cpp, Y = G V_d only).
// A panel of R rows of A (R * n * 4 bytes, L1/L2-resident) is read once for the R
// dot-product rows of Y (R x b accumulators held in vector registers) and once more, from
// cache, for the rank-R update of Z.
// Vector code: GCC/Clang vector extensions in functions compiled for avx512f or avx2+fma
// (target attributes; the rest of the extension keeps the default flags) and chosen at
// run time from the CPU's features. Supported: b a multiple of 16 up to 64 with AVX-512,
// b in {8, 16} with AVX2 (wider blocks spilled registers and ran at ~15 GFLOP/s there);
// pick_row_panels(b) returns nullptr otherwise.
#pragma once

#include <cstdint>
#include <cstring>

namespace meshkern {
namespace row_panel {

// Y = A V ([m, b] row-major) and, with Z != nullptr, Z += A^T Y ([n, b] k-major; Z must be
// zeroed by the caller). Each row of Y and each element of Z is computed in a fixed order.
using MatrixFn = void (*)(const float* A, int64_t m, int64_t n, const float* V, float* Y, float* Z);

namespace detail {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MESHKERN_ROW_PANEL_SIMD 1

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
}  // namespace detail

inline MatrixFn pick_row_panels(int64_t b) {
  using namespace detail;
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
}  // namespace detail
inline MatrixFn pick_row_panels(int64_t) { return nullptr; }
#endif


}  // namespace row_panel
}  // namespace meshkern
