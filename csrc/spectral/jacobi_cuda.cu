// CUDA kernel of meshkern_C::sym_eig_jacobi: one thread block per matrix, the k x k
// problem and its eigenvectors in shared memory, parallel (round-robin) Jacobi: each
// round rotates k/2 disjoint pairs at once (the same tournament pairing as the Triton
// kernel), with the rotation formula shared with the CPU kernel (jacobi.h).
// Fixed number of sweeps: deterministic results and cost.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "jacobi.h"

namespace {

constexpr int kMaxHalf = 64;  // k <= 128
constexpr int kThreads = 256;

template <typename T>
__global__ void jacobi_kernel(const T* __restrict__ A, T* __restrict__ w, T* __restrict__ W, int k, int sweeps) {
  extern __shared__ unsigned char smem_raw[];
  T* a = reinterpret_cast<T*>(smem_raw);
  T* v = a + k * k;
  __shared__ T cs[kMaxHalf];
  __shared__ T sn[kMaxHalf];
  __shared__ int pp[kMaxHalf];
  __shared__ int qq[kMaxHalf];
  const int64_t b = blockIdx.x;
  const T* Ab = A + b * k * k;
  for (int e = threadIdx.x; e < k * k; e += blockDim.x) {
    const int i = e / k, j = e % k;
    a[e] = T(0.5) * (Ab[i * k + j] + Ab[j * k + i]);
    v[e] = i == j ? T(1) : T(0);
  }
  __syncthreads();
  const int n = k + (k & 1);  // odd k: one dummy player; its pair is skipped
  const int n1 = n - 1, half = n / 2;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    for (int r = 0; r < n1; ++r) {
      // pair t of round r: (r, n1) for t = 0, else (r - t, r + t) mod n1 (circle method)
      for (int t = threadIdx.x; t < half; t += blockDim.x) {
        int p = t == 0 ? r : (r - t + n1) % n1;
        int q = t == 0 ? n1 : (r + t) % n1;
        if (p > q) {
          const int tmp = p;
          p = q;
          q = tmp;
        }
        T c = T(1), s = T(0);
        if (q < k) meshkern_spectral::jacobi_rotation<T>(a[p * k + p], a[q * k + q], a[p * k + q], c, s);
        cs[t] = c;
        sn[t] = s;
        pp[t] = p;
        qq[t] = q;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < half * k; e += blockDim.x) {  // rows p, q of J^T A
        const int t = e / k, j = e % k, p = pp[t], q = qq[t];
        if (q >= k) continue;
        meshkern_spectral::rotate_pair(a[p * k + j], a[q * k + j], cs[t], sn[t]);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < half * k; e += blockDim.x) {  // columns p, q of (J^T A) J and W J
        const int t = e / k, i = e % k, p = pp[t], q = qq[t];
        if (q >= k) continue;
        meshkern_spectral::rotate_pair(a[i * k + p], a[i * k + q], cs[t], sn[t]);
        meshkern_spectral::rotate_pair(v[i * k + p], v[i * k + q], cs[t], sn[t]);
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x) w[b * k + i] = a[i * k + i];
  for (int e = threadIdx.x; e < k * k; e += blockDim.x) W[b * k * k + e] = v[e];
}

std::tuple<at::Tensor, at::Tensor> sym_eig_jacobi_cuda(const at::Tensor& A_in, int64_t sweeps) {
  TORCH_CHECK(A_in.dim() == 3 && A_in.size(1) == A_in.size(2), "sym_eig_jacobi: A must be [B, k, k], got ",
              A_in.sizes());
  TORCH_CHECK(A_in.scalar_type() == at::kFloat || A_in.scalar_type() == at::kDouble,
              "sym_eig_jacobi: A must be float32 or float64, got ", A_in.scalar_type());
  TORCH_CHECK(sweeps >= 1, "sym_eig_jacobi: sweeps must be >= 1, got ", sweeps);
  const c10::cuda::CUDAGuard guard(A_in.device());
  const at::Tensor A = A_in.contiguous();
  const int64_t B = A.size(0), k = A.size(1);
  TORCH_CHECK(k <= 2 * kMaxHalf, "sym_eig_jacobi (CUDA): k <= ", 2 * kMaxHalf, ", got ", k);
  const size_t smem = 2 * size_t(k) * size_t(k) * A.element_size();
  TORCH_CHECK(smem <= 48 * 1024, "sym_eig_jacobi (CUDA): a ", k, "x", k, " ", A.scalar_type(),
              " problem needs ", smem, " bytes of shared memory (limit 48 KiB: k <= 78 fp32, k <= 55 fp64)");
  at::Tensor w = at::empty({B, k}, A.options());
  at::Tensor W = at::empty({B, k, k}, A.options());
  if (B == 0 || k == 0) return {w, W};
  AT_DISPATCH_FLOATING_TYPES(A.scalar_type(), "sym_eig_jacobi_cuda", [&] {
    jacobi_kernel<scalar_t><<<static_cast<unsigned>(B), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        A.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), W.data_ptr<scalar_t>(), static_cast<int>(k),
        static_cast<int>(sweeps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {w, W};
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CUDA, m) { m.impl("sym_eig_jacobi", &sym_eig_jacobi_cuda); }
