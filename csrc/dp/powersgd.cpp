// meshkern_C PowerSGD kernel: schema (all devices) and the CPU implementation.
//
//   powersgd_ef_project(grad[B,n,m], err[B,n,m]!, q[B,m,r]) -> p[B,n,r]
//       err += grad; p = err @ q        (one pass over the big buffers instead of two)
//
// The other fused step, reconstruction with the error update (out = p q^T; err -= out),
// was written too and removed: blocked to keep the tile in L1 it measured 0.75-1.0x of
// torch's bmm + sub_ on one thread (Llama-3.2-1B layer shapes, r 8 and 32), so
// meshkern.powersgd_reconstruct runs the torch reference everywhere.
//
// Rows of the [B*n, m] view are independent: at::parallel_for splits them across
// torch's intra-op threads. Each output element's sum runs in a fixed order
// (j = 0..m-1), so results do not depend on the thread count.
// Accumulation in at::opmath_type (fp32 for half types). Inputs must be contiguous
// (the Python wrapper makes them so, and uses the reference when err is not).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "parallel.h"

namespace meshkern {
namespace dp {
namespace {

void check(const at::Tensor& big, const at::Tensor& q, const char* name) {
  TORCH_CHECK(big.dim() == 3 && q.dim() == 3, name, ": expected 3-D tensors");
  TORCH_CHECK(big.is_contiguous() && q.is_contiguous(), name, ": expected contiguous tensors");
  TORCH_CHECK(big.scalar_type() == q.scalar_type(), name, ": dtypes differ");
}

template <typename scalar_t>
void ef_project_kernel(const scalar_t* G, scalar_t* E, const scalar_t* Q, scalar_t* P, int64_t B, int64_t n,
                       int64_t m, int64_t r) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, B * n, grain(m * r), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(r);
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* qb = Q + (row / n) * m * r;
      const scalar_t* g = G + row * m;
      scalar_t* e = E + row * m;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      acc_t* a = acc.data();
      for (int64_t j = 0; j < m; ++j) {
        const scalar_t v = static_cast<scalar_t>(static_cast<acc_t>(e[j]) + static_cast<acc_t>(g[j]));
        e[j] = v;  // stored in err's dtype, and that rounded value is what is projected
        const acc_t vf = static_cast<acc_t>(v);
        const scalar_t* qj = qb + j * r;
#pragma omp simd
        for (int64_t k = 0; k < r; ++k) a[k] += vf * static_cast<acc_t>(qj[k]);
      }
      for (int64_t k = 0; k < r; ++k) P[row * r + k] = static_cast<scalar_t>(a[k]);
    }
  });
}


// ---- fp32 fast paths --------------------------------------------------------------------
// For fp32 and r in {1,2,4,8,16,32}, r is a compile-time constant so the accumulators
// live in registers, and ROWS rows share every load of q (register blocking): measured
// 2-4x faster than the runtime-r loops above, which lost to MKL's bmm. Each exists as an
// AVX2+FMA clone (chosen at run time with __builtin_cpu_supports) and a baseline clone,
// because setup.py builds without -march (portable wheels). Summation order per output
// element is the same in every clone and row block: j = 0..m-1, so results do not depend on threads or the clone except
// for FMA contraction (last-bit differences between CPUs).
#define MESHKERN_DP_FAST_KERNELS(SUFFIX, ATTR)                                                      \
  template <int R>                                                                                \
  ATTR void ef_rows_##SUFFIX(const float* G, float* E, const float* Q, float* P, int64_t n,        \
                             int64_t m, int64_t begin, int64_t end) {                             \
    constexpr int ROWS = R <= 8 ? 4 : 2;                                                          \
    int64_t row = begin;                                                                          \
    for (; row < end; row += ROWS) {                                                              \
      const int64_t nrows = std::min<int64_t>(ROWS, end - row);                                   \
      /* rows of one block must share a batch entry (same q) */                                   \
      const int64_t same = std::min<int64_t>(nrows, n - row % n);                                 \
      if (same < ROWS) {                                                                          \
        for (int64_t rr = row; rr < row + same; ++rr) {                                           \
          float acc[R] = {};                                                                      \
          const float* qb = Q + (rr / n) * m * R;                                                 \
          const float* g = G + rr * m;                                                            \
          float* e = E + rr * m;                                                                  \
          for (int64_t j = 0; j < m; ++j) {                                                       \
            const float v = e[j] + g[j];                                                          \
            e[j] = v;                                                                             \
            for (int k = 0; k < R; ++k) acc[k] += v * qb[j * R + k];                              \
          }                                                                                       \
          for (int k = 0; k < R; ++k) P[rr * R + k] = acc[k];                                     \
        }                                                                                         \
        row = row + same - ROWS;                                                                  \
        continue;                                                                                 \
      }                                                                                           \
      float acc[ROWS][R] = {};                                                                    \
      const float* qb = Q + (row / n) * m * R;                                                    \
      for (int64_t j = 0; j < m; ++j) {                                                           \
        float v[ROWS];                                                                            \
        for (int i = 0; i < ROWS; ++i) {                                                          \
          v[i] = E[(row + i) * m + j] + G[(row + i) * m + j];                                     \
          E[(row + i) * m + j] = v[i];                                                            \
        }                                                                                         \
        const float* qj = qb + j * R;                                                             \
        for (int k = 0; k < R; ++k)                                                               \
          for (int i = 0; i < ROWS; ++i) acc[i][k] += v[i] * qj[k];                               \
      }                                                                                           \
      for (int i = 0; i < ROWS; ++i)                                                              \
        for (int k = 0; k < R; ++k) P[(row + i) * R + k] = acc[i][k];                             \
    }                                                                                             \
  }

MESHKERN_DP_FAST_KERNELS(base, )
MESHKERN_DP_FAST_KERNELS(avx2, __attribute__((target("avx2,fma"))))
#undef MESHKERN_DP_FAST_KERNELS

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

template <int R>
void ef_project_f32(const float* G, float* E, const float* Q, float* P, int64_t B, int64_t n, int64_t m) {
  at::parallel_for(0, B * n, grain(m * R), [&](int64_t begin, int64_t end) {
    if (has_avx2()) ef_rows_avx2<R>(G, E, Q, P, n, m, begin, end);
    else ef_rows_base<R>(G, E, Q, P, n, m, begin, end);
  });
}

// Calls F<R>(args...) for R = r when r is one of the specialized ranks; false otherwise.
#define MESHKERN_DP_WITH_RANK(r, CALL)          \
  switch (r) {                                  \
    case 1: { constexpr int R_ = 1; CALL; break; }  \
    case 2: { constexpr int R_ = 2; CALL; break; }  \
    case 4: { constexpr int R_ = 4; CALL; break; }  \
    case 8: { constexpr int R_ = 8; CALL; break; }  \
    case 16: { constexpr int R_ = 16; CALL; break; } \
    case 32: { constexpr int R_ = 32; CALL; break; } \
    default: fast = false;                      \
  }

at::Tensor ef_project_cpu(const at::Tensor& grad, at::Tensor& err, const at::Tensor& q) {
  check(err, q, "powersgd_ef_project");
  TORCH_CHECK(grad.sizes() == err.sizes() && grad.is_contiguous() && grad.scalar_type() == err.scalar_type(),
              "powersgd_ef_project: grad must be contiguous and match err");
  const int64_t B = err.size(0), n = err.size(1), m = err.size(2), r = q.size(2);
  TORCH_CHECK(q.size(0) == B && q.size(1) == m, "powersgd_ef_project: q must be [B, m, r]");
  at::Tensor p = at::empty({B, n, r}, err.options());
  bool fast = err.scalar_type() == at::kFloat;
  if (fast) {
    const float* G = grad.const_data_ptr<float>();
    float* E = err.mutable_data_ptr<float>();
    const float* Q = q.const_data_ptr<float>();
    float* P = p.mutable_data_ptr<float>();
    MESHKERN_DP_WITH_RANK(r, (ef_project_f32<R_>(G, E, Q, P, B, n, m)))
  }
  if (!fast) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, err.scalar_type(), "powersgd_ef_project", [&] {
    ef_project_kernel<scalar_t>(grad.const_data_ptr<scalar_t>(), err.mutable_data_ptr<scalar_t>(),
                                q.const_data_ptr<scalar_t>(), p.mutable_data_ptr<scalar_t>(), B, n, m, r);
  });
  return p;
}

}  // namespace
}  // namespace dp
}  // namespace meshkern

TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  m.def("powersgd_ef_project(Tensor grad, Tensor(a!) err, Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("powersgd_ef_project", &meshkern::dp::ef_project_cpu);
}
