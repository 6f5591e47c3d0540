// Cyclic Jacobi eigen-solver for one small symmetric matrix, shared by the CPU kernel
// (and readable as the spec of the CUDA/Triton round-robin variants).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define MESHKERN_HD __host__ __device__
#else
#define MESHKERN_HD
#endif

namespace meshkern_spectral {

template <typename T>
MESHKERN_HD inline T mk_sqrt(T x) {
#ifdef __CUDA_ARCH__
  return sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// Rotation that zeroes a_pq in J^T A J, J = [[c, s], [-s, c]] on rows/cols (p, q)
// (Golub & Van Loan, Algorithm 8.4.1 "sym.schur2"). Returns false if a_pq == 0.
// Shared by the CPU kernel and the CUDA kernel (jacobi_cuda.cu).
template <typename acc_t>
MESHKERN_HD inline bool jacobi_rotation(acc_t app, acc_t aqq, acc_t apq, acc_t& c, acc_t& s) {
  if (apq == acc_t(0)) {
    c = acc_t(1);
    s = acc_t(0);
    return false;
  }
  const acc_t theta = (aqq - app) / (acc_t(2) * apq);
  const acc_t at = theta < acc_t(0) ? -theta : theta;
  // t = 1/(|theta| + sqrt(1 + theta^2)), written so that it cannot overflow: for
  // |theta| >= 1 divide through by |theta| (t -> 0 as |theta| -> inf: no rotation).
  acc_t t;
  if (at >= acc_t(1)) {
    const acc_t inv = acc_t(1) / at;
    t = inv / (acc_t(1) + mk_sqrt(acc_t(1) + inv * inv));
  } else {
    t = acc_t(1) / (at + mk_sqrt(acc_t(1) + at * at));
  }
  if (theta < acc_t(0)) t = -t;
  c = acc_t(1) / mk_sqrt(acc_t(1) + t * t);
  s = t * c;
  return true;
}

// (x, y) <- (c x - s y, s x + c y): one rotation of a row or column pair.
template <typename T>
MESHKERN_HD inline void rotate_pair(T& x, T& y, T c, T s) {
  const T a = x, b = y;
  x = c * a - s * b;
  y = s * a + c * b;
}

// A (k*k, row-major, symmetric, overwritten by its rotated form) -> w = diag, V (k*k,
// ROWS are the eigenvectors, i.e. V^T of A = V diag(w) V^T). Cyclic row-by-row sweeps in double. A pair is skipped (its
// a_pq set to 0) once |a_pq| <= rel_tol * sqrt(|a_pp a_qq|) or |a_pq| <= abs_floor,
// the classic threshold that keeps the eigenvalues to relative accuracy ~rel_tol
// (Demmel & Veselic 1992); the solve ends after the first sweep without a rotation or
// after max_sweeps. rel_tol: 1e-9 for fp32 outputs, 1e-15 for fp64 (callers' choice).
inline void jacobi_eig(std::vector<double>& A, std::vector<double>& V, std::vector<double>& w, int64_t k,
                       int64_t max_sweeps, double rel_tol) {
  V.assign(k * k, 0.0);
  for (int64_t i = 0; i < k; ++i) V[i * k + i] = 1.0;
  double fro = 0.0;
  for (double x : A) fro += x * x;
  const double abs_floor = 1e-300 + rel_tol * 1e-3 * std::sqrt(fro);  // entries this small are noise
  for (int64_t sweep = 0; sweep < max_sweeps; ++sweep) {
    bool rotated = false;
    for (int64_t p = 0; p < k - 1; ++p) {
      for (int64_t q = p + 1; q < k; ++q) {
        const double apq = A[p * k + q];
        const double scale = std::sqrt(std::fabs(A[p * k + p] * A[q * k + q]));
        if (std::fabs(apq) <= rel_tol * scale || std::fabs(apq) <= abs_floor) {
          A[p * k + q] = A[q * k + p] = 0.0;
          continue;
        }
        double c, s;
        jacobi_rotation<double>(A[p * k + p], A[q * k + q], apq, c, s);
        rotated = true;
        // J^T A J touching contiguous memory only: rotate rows p, q (for r != p, q the new
        // column entries equal the new row entries by symmetry), then the 2x2 block in
        // closed form (G&VL 8.4: a_pp - t a_pq, a_qq + t a_pq, a_pq -> 0, t = s / c).
        const double app = A[p * k + p], aqq = A[q * k + q], t = s / c;
        for (int64_t r = 0; r < k; ++r) rotate_pair(A[p * k + r], A[q * k + r], c, s);
        for (int64_t r = 0; r < k; ++r) {
          A[r * k + p] = A[p * k + r];
          A[r * k + q] = A[q * k + r];
        }
        A[p * k + p] = app - t * apq;
        A[q * k + q] = aqq + t * apq;
        A[p * k + q] = A[q * k + p] = 0.0;  // exact zero by construction of the rotation
        // V is kept transposed (row i = eigenvector i) so this update is contiguous too.
        for (int64_t r = 0; r < k; ++r) rotate_pair(V[p * k + r], V[q * k + r], c, s);
      }
    }
    if (!rotated) break;
  }
  w.resize(k);
  for (int64_t i = 0; i < k; ++i) w[i] = A[i * k + i];
}

}  // namespace meshkern_spectral
