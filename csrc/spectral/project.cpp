// meshkern_C::spectral_project for CPU and CUDA tensors.
//
// The two m*n*r GEMMs are the unavoidable cost; BLAS / cuBLAS already run them at peak,
// so this kernel does not re-implement them. What it fuses is everything around them:
//   X  = U^T (G V)                      GEMM 1 (m n r) + a small m r r GEMM
//   Xf = (1-alpha) diag(d) X diag(d)    r x r, never an m x n temporary
//   W  = U Xf                           m r r
//   out = alpha * G + W V^T             GEMM 2 with the mix in its epilogue (baddbmm beta)
// versus the unfused chain, which materialises U Xf V^T and then alpha*G + (1-alpha)*...
// (two more m x n passes).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor> spectral_project_impl(const at::Tensor& G, const at::Tensor& U,
                                                         const at::Tensor& S, const at::Tensor& V, double tau,
                                                         double alpha) {
  TORCH_CHECK(G.dim() == 3, "spectral_project: G must be [B, m, n], got ", G.sizes());
  const int64_t B = G.size(0), m = G.size(1), n = G.size(2);
  TORCH_CHECK(U.dim() == 3 && U.size(0) == B && U.size(1) == m, "spectral_project: U must be [B, m, r], got ",
              U.sizes());
  const int64_t r = U.size(2);
  TORCH_CHECK(S.dim() == 2 && S.size(0) == B && S.size(1) == r, "spectral_project: S must be [B, r], got ", S.sizes());
  TORCH_CHECK(V.dim() == 3 && V.size(0) == B && V.size(1) == n && V.size(2) == r,
              "spectral_project: V must be [B, n, r], got ", V.sizes());
  TORCH_CHECK(tau >= 0.0, "spectral_project: tau must be >= 0, got ", tau);
  TORCH_CHECK(alpha >= 0.0 && alpha <= 1.0, "spectral_project: alpha must lie in [0, 1], got ", alpha);
  TORCH_CHECK(G.is_floating_point(), "spectral_project: G must be floating point, got ", G.scalar_type());

  // Small r x r math in fp32 (fp64 for fp64 G). The two big GEMMs run in G's dtype:
  // for bf16/fp16 that is the BLAS's half-precision GEMM with fp32 accumulation (tensor
  // cores on GPUs), rounding once per GEMM output -- fewer roundings than the same-
  // precision torch chain, and no fp32 copy of G (measured: converting G to fp32 first
  // was slower than the whole bf16 chain on this CPU).
  const auto gd = G.scalar_type();
  const auto wd = gd == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor Vg = V.to(gd);
  const at::Tensor Uw = U.to(wd);
  const at::Tensor s = S.to(wd).clamp_min(0);
  const at::Tensor den = s + tau;
  const at::Tensor d = at::where(den > 0, s / at::where(den > 0, den, at::ones_like(den)), at::zeros_like(s));
  const at::Tensor GV = at::bmm(G, Vg).to(wd);                                  // GEMM 1: [B, m, r]
  const at::Tensor X = at::bmm(Uw.transpose(1, 2), GV);                         // [B, r, r]
  const at::Tensor Xf = X * d.unsqueeze(2) * d.unsqueeze(1);                    // diag(d) X diag(d)
  const at::Tensor filt_sq = Xf.square().sum({1, 2}).to(at::kFloat);
  if (alpha == 1.0) return {G.clone(at::MemoryFormat::Contiguous), filt_sq};   // exactly G
  const at::Tensor W = at::bmm(Uw, Xf * (1.0 - alpha)).to(gd);                  // [B, m, r]
  // GEMM 2 with the mix in its epilogue: out = alpha * G + W V^T
  at::Tensor out = at::baddbmm(G, W, Vg.transpose(1, 2), /*beta=*/alpha, /*alpha=*/1.0);
  return {out.contiguous(), filt_sq};
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) { m.impl("spectral_project", &spectral_project_impl); }

#ifdef MESHKERN_WITH_CUDA
// Same ATen composition; on CUDA tensors the GEMMs run in cuBLAS.
TORCH_LIBRARY_IMPL(meshkern_C, CUDA, m) { m.impl("spectral_project", &spectral_project_impl); }
#endif
