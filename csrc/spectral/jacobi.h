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

// A (k*k, row-major, symmetric, overwritten by its rotated form) -> w = diag, V (k*k,
// columns are eigenvectors). Cyclic row-by-row sweeps in double; stops early once the
// off-diagonal mass is below eps * ||A||_F.
inline void jacobi_eig(std::vector<double>& A, std::vector<double>& V, std::vector<double>& w, int64_t k,
                       int64_t max_sweeps) {
  V.assign(k * k, 0.0);
  for (int64_t i = 0; i < k; ++i) V[i * k + i] = 1.0;
  double fro = 0.0;
  for (double x : A) fro += x * x;
  const double tol = 1e-30 * fro;  // (1e-15 ||A||_F)^2: double precision floor
  for (int64_t sweep = 0; sweep < max_sweeps; ++sweep) {
    double off = 0.0;
    for (int64_t p = 0; p < k; ++p)
      for (int64_t q = p + 1; q < k; ++q) off += A[p * k + q] * A[p * k + q];
    if (off <= tol) break;
    for (int64_t p = 0; p < k - 1; ++p) {
      for (int64_t q = p + 1; q < k; ++q) {
        double c, s;
        if (!jacobi_rotation<double>(A[p * k + p], A[q * k + q], A[p * k + q], c, s)) continue;
        for (int64_t r = 0; r < k; ++r) {  // columns p, q of A and V
          const double arp = A[r * k + p], arq = A[r * k + q];
          A[r * k + p] = c * arp - s * arq;
          A[r * k + q] = s * arp + c * arq;
          const double vrp = V[r * k + p], vrq = V[r * k + q];
          V[r * k + p] = c * vrp - s * vrq;
          V[r * k + q] = s * vrp + c * vrq;
        }
        for (int64_t r = 0; r < k; ++r) {  // rows p, q of A
          const double apr = A[p * k + r], aqr = A[q * k + r];
          A[p * k + r] = c * apr - s * aqr;
          A[q * k + r] = s * apr + c * aqr;
        }
        A[p * k + q] = A[q * k + p] = 0.0;  // exact zero by construction of the rotation
      }
    }
  }
  w.resize(k);
  for (int64_t i = 0; i < k; ++i) w[i] = A[i * k + i];
}

}  // namespace meshkern_spectral
