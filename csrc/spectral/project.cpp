// meshkern_C::spectral_project_out for CPU and CUDA tensors: writes G_proj into a
// caller-owned `out` and returns ||G_filt||_F^2 per batch entry. The allocating public op
// (meshkern::spectral_project) allocates `out` and calls this same kernel, so both
// variants give the same bits.
//
// The two m*n*r GEMMs are the unavoidable cost; BLAS / cuBLAS already run them at peak,
// so this kernel does not re-implement them. What it fuses is everything around them:
//   X  = U^T (G V)                      GEMM 1 (m n r) + a small m r r GEMM
//   Xf = (1-alpha) diag(d) X diag(d)    r x r, never an m x n temporary
//   W  = U Xf                           m r r
//   out = alpha * G;  out += W V^T      GEMM 2 accumulating into out (beta = 1)
// versus the unfused chain, which materialises U Xf V^T and then alpha*G + (1-alpha)*...
// (two more m x n passes).
//
// Why `out` at all: on CPU a fresh [m, n] result is a fresh mmap (glibc serves > 32 MiB
// from mmap and torch's CPU allocator does not cache), and its first-touch page faults
// cost more than the GEMM that fills it (one [8192, 2048] fp32 matrix, 1 thread: 49 ms
// into new memory vs 20 ms into a warm buffer). A caller that keeps `out` between calls
// (SpectralAdamW) skips that.
//
// In place: G is read by GEMM 1 before `out` is first written, and the scale is
// elementwise, so out == G would be safe here; the Python op still rejects any overlap
// of `out` with an input (a custom op's mutated argument must not alias another input).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// G V for G[B, m, n], V[B, n, r]. On CPU in calls of at most 2048 rows: MKL ran the tall
// [8192, 2048] x [2048, 32] product at ~21.7 ms in one call and ~17.2 ms in four (1 thread;
// 512 / 1024-row calls were not better, and no other Llama-1B shape gained). Every row of
// G V is the same dot products either way (bits equal in our checks).
at::Tensor gemm_gv(const at::Tensor& G, const at::Tensor& V) {
  constexpr int64_t kRows = 2048;
  const int64_t B = G.size(0), m = G.size(1);
  if (!G.is_cpu() || m <= kRows) return at::bmm(G, V);
  at::Tensor GV = at::empty({B, m, V.size(2)}, G.options());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < m; i += kRows) {
      const int64_t len = std::min(kRows, m - i);
      at::Tensor o = GV[b].narrow(0, i, len);
      at::mm_out(o, G[b].narrow(0, i, len), V[b]);
    }
  }
  return GV;
}

at::Tensor spectral_project_out_impl(const at::Tensor& G, const at::Tensor& U, const at::Tensor& S,
                                     const at::Tensor& V, double tau, double alpha, at::Tensor& out) {
  TORCH_CHECK(G.dim() == 3, "spectral_project_out: G must be [B, m, n], got ", G.sizes());
  const int64_t B = G.size(0), m = G.size(1), n = G.size(2);
  TORCH_CHECK(U.dim() == 3 && U.size(0) == B && U.size(1) == m, "spectral_project_out: U must be [B, m, r], got ",
              U.sizes());
  const int64_t r = U.size(2);
  TORCH_CHECK(S.dim() == 2 && S.size(0) == B && S.size(1) == r, "spectral_project_out: S must be [B, r], got ",
              S.sizes());
  TORCH_CHECK(V.dim() == 3 && V.size(0) == B && V.size(1) == n && V.size(2) == r,
              "spectral_project_out: V must be [B, n, r], got ", V.sizes());
  TORCH_CHECK(tau >= 0.0, "spectral_project_out: tau must be >= 0, got ", tau);
  TORCH_CHECK(alpha >= 0.0 && alpha <= 1.0, "spectral_project_out: alpha must lie in [0, 1], got ", alpha);
  TORCH_CHECK(G.is_floating_point(), "spectral_project_out: G must be floating point, got ", G.scalar_type());
  TORCH_CHECK(out.sizes() == G.sizes() && out.scalar_type() == G.scalar_type() && out.device() == G.device(),
              "spectral_project_out: out must match G (", G.sizes(), ", ", G.scalar_type(), ", ", G.device(),
              "), got ", out.sizes(), ", ", out.scalar_type(), ", ", out.device());
  TORCH_CHECK(out.is_contiguous(), "spectral_project_out: out must be contiguous");

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
  const at::Tensor GV = gemm_gv(G, Vg).to(wd);                                  // GEMM 1: [B, m, r]
  const at::Tensor X = at::bmm(Uw.transpose(1, 2), GV);                         // [B, r, r]
  const at::Tensor Xf = X * d.unsqueeze(2) * d.unsqueeze(1);                    // diag(d) X diag(d)
  const at::Tensor filt_sq = Xf.square().sum({1, 2}).to(at::kFloat);
  if (alpha == 1.0) {  // exactly G
    out.copy_(G);
    return filt_sq;
  }
  const at::Tensor W = at::bmm(Uw, Xf * (1.0 - alpha)).to(gd);                  // [B, m, r]
  // GEMM 2 accumulating into alpha * G. fp32/fp64: scale first, then a beta = 1 GEMM:
  // 20 ms vs 23 ms for baddbmm_out(beta = alpha) on [8192, 2048] fp32, 1 thread (that one
  // copies G into out and lets the BLAS scale it: one more pass), same bits on MKL in our
  // check. bf16/fp16: beta = alpha inside the GEMM, whose fp32 epilogue rounds alpha*G + WV^T
  // once; scaling first would round alpha*G to 16 bits on its own (one more rounding).
  const at::Tensor Vt = Vg.transpose(1, 2);
  if (gd != at::kFloat && gd != at::kDouble) {
    at::baddbmm_out(out, G, W, Vt, /*beta=*/alpha, /*alpha=*/1.0);
    return filt_sq;
  }
  // alpha as a 0-dim tensor of G's dtype: a plain double would be promoted and the
  // product computed in fp64 into a temporary (measured: 34 ms instead of 6 ms).
  const at::Tensor a = at::scalar_tensor(alpha, G.options());
  if (!out.is_cpu()) {
    at::mul_out(out, G, a);
    out.baddbmm_(W, Vt);
    return filt_sq;
  }
  // CPU: scale and accumulate one block of ~2 MiB of out rows at a time, so the GEMM finds
  // the scaled rows still in cache instead of streaming out through memory twice. Each
  // element's arithmetic is the same (bits equal to the unblocked form in our checks up to
  // [8192, 2048]; each block is its own GEMM call). 1 thread, fp32: [2048, 8192] 25 -> 17
  // ms, [8192, 2048] 18.8 -> 17.6 ms; 1 MiB and 4 MiB blocks were no better.
  const int64_t rows = std::max<int64_t>(1, (int64_t{2} << 20) / std::max<int64_t>(1, n * out.element_size()));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < m; i += rows) {
      const int64_t len = std::min(rows, m - i);
      at::Tensor o = out[b].narrow(0, i, len);
      at::mul_out(o, G[b].narrow(0, i, len), a);
      o.addmm_(W[b].narrow(0, i, len), Vt[b]);
    }
  }
  return filt_sq;
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) { m.impl("spectral_project_out", &spectral_project_out_impl); }

#ifdef MESHKERN_WITH_CUDA
// Same ATen composition; on CUDA tensors the GEMMs run in cuBLAS.
TORCH_LIBRARY_IMPL(meshkern_C, CUDA, m) { m.impl("spectral_project_out", &spectral_project_out_impl); }
#endif
