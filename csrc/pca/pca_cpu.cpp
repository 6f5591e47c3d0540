// meshkern_C::pca_project / pca_quantize_rows / pca_decode on CPU tensors (the pca
// codec's wire math; the spec is meshkern/pca.py's reference).
//
// project: rows go in blocks (block_rows): a block's x - mean is formed
// in a per-thread buffer (widened to fp32), handed to the BLAS GEMM (at::mm_out into the
// block's rows of c) while still in cache, and divided by norm in place. The unfused torch
// chain writes x.float(), x - mean and x @ U (plus a slice copy of x for the sink layout).
// quantize: per row, absmax, scale = absmax / qmax (1 for an all-zero row), q =
// round-half-even(v / scale) (as torch.round; quantize_one) clamped to +-qmax, nibbles
// packed as they are produced. IEEE fp32 division (no -ffast-math), so given the same
// values the codes and scales are the reference's bit for bit.
// decode: per block, c = (q * scale) * norm (the reference's fp32 order) in a buffer, one
// GEMM c @ U^T into an fp32 block, + mean, rounded once into the output rows.
// Blocks are independent: at::parallel_for splits them across torch's intra-op threads;
// a row's arithmetic does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>

#include "parallel.h"

namespace {

// Rows per block: ~256 KiB of fp32 (L2-sized), but at least 256 rows: the codec's k is
// ~H/2 (288 at H=576, 1050 at H=2048), so the GEMM dominates and a 32-row GEMM (what 256
// KiB gives at H=2048) ran ~1.3x slower per row than MKL on the whole matrix.
constexpr int64_t kBlockBytes = 256 * 1024;
constexpr int64_t kMinBlockRows = 256;

struct RowMap {
  int64_t rb, rs, r0;
  int64_t operator()(int64_t i) const { return (i / rb) * rs + i % rb + r0; }
};

RowMap row_map(at::IntArrayRef m, const char* op) {
  TORCH_CHECK(m.size() == 3 && m[0] >= 1 && m[1] >= m[0] && m[2] >= 0, op, ": rowmap must be [rb, rs, r0]");
  return {m[0], m[1], m[2]};
}

int64_t block_rows(int64_t width) {
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(1, width * 4), kMinBlockRows, 1 << 20);
}

void check_basis(const char* op, const at::Tensor& U, const at::Tensor& norm, const std::optional<at::Tensor>& mean) {
  TORCH_CHECK(U.dim() == 2 && U.scalar_type() == at::kFloat, op, ": U must be fp32 [H, k]");
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == U.size(1) && norm.scalar_type() == at::kFloat, op,
              ": norm must be fp32 [k]");
  TORCH_CHECK(!mean || (mean->dim() == 1 && mean->size(0) == U.size(0) && mean->scalar_type() == at::kFloat), op,
              ": mean must be fp32 [H]");
}

// The largest memory row a row map reaches for N kernel rows (for the bounds check).
int64_t last_row(const RowMap& m, int64_t N) { return N ? m(N - 1) : -1; }

at::Tensor pca_project_cpu(const at::Tensor& x_in, int64_t N, at::IntArrayRef rowmap,
                           const std::optional<at::Tensor>& mean_in, const at::Tensor& U_in, const at::Tensor& norm_in) {
  check_basis("pca_project", U_in, norm_in, mean_in);
  const RowMap rm = row_map(rowmap, "pca_project");
  const int64_t H = U_in.size(0), k = U_in.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H, "pca_project: x must be [rows, H=", H, "]");
  TORCH_CHECK(last_row(rm, N) < x_in.size(0), "pca_project: the row map reaches past x's rows");
  const at::Tensor x = x_in.contiguous(), U = U_in.contiguous(), norm = norm_in.contiguous();
  std::optional<at::Tensor> mean;
  if (mean_in) mean = mean_in->contiguous();
  at::Tensor c = at::empty({N, k}, x.options().dtype(at::kFloat));
  if (N == 0) return c;
  const int64_t R = block_rows(H), nblocks = (N + R - 1) / R;
  const float* mp = mean ? mean->const_data_ptr<float>() : nullptr;
  const float* np = norm.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "pca_project", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      std::unique_ptr<float[]> buf(new float[static_cast<size_t>(R * H)]);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t i0 = blk * R, rows = std::min(R, N - i0);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* __restrict xr = xp + rm(i0 + r) * H;
          float* __restrict t = buf.get() + r * H;
          if (mp != nullptr) {
            for (int64_t j = 0; j < H; ++j) t[j] = static_cast<float>(xr[j]) - mp[j];
          } else {
            for (int64_t j = 0; j < H; ++j) t[j] = static_cast<float>(xr[j]);
          }
        }
        at::Tensor cb = c.narrow(0, i0, rows);
        at::mm_out(cb, at::from_blob(buf.get(), {rows, H}, c.options()), U);
        float* cp = cb.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < k; ++j) cp[r * k + j] /= np[j];
      }
    });
  });
  return c;
}

// round(v / scale) half to even, clamped: adding and subtracting 1.5 * 2^23 rounds any
// |y| < 2^22 to an integer in the current (default: nearest-even) rounding mode, as
// std::nearbyint and torch.round do, without a libm call per element; |v / scale| <=
// qmax (+ rounding) here. Relies on IEEE fp32 arithmetic (no -ffast-math).
inline float quantize_one(float v, float scale, float qmax) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  const float y = v / scale;
  const float t = y + kMagic;  // rounded here; (y + M) - M is not folded without -ffast-math
  return std::clamp(t - kMagic, -qmax, qmax);
}

std::tuple<at::Tensor, at::Tensor> pca_quantize_rows_cpu(const at::Tensor& src_in, int64_t N, int64_t W,
                                                         at::IntArrayRef rowmap, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pca_quantize_rows: bits must be 4 or 8, got ", bits);
  const RowMap rm = row_map(rowmap, "pca_quantize_rows");
  TORCH_CHECK(src_in.numel() == 0 || src_in.size(-1) == W, "pca_quantize_rows: src rows must be W=", W, " wide");
  const at::Tensor src = src_in.contiguous().reshape({-1, W});
  TORCH_CHECK(last_row(rm, N) < src.size(0), "pca_quantize_rows: the row map reaches past src's rows");
  const bool int4 = bits == 4;
  const float qmax = int4 ? 7.0f : 127.0f;
  const int64_t cw = int4 ? (W + 1) / 2 : W;
  at::Tensor q = at::empty({N, cw}, src.options().dtype(int4 ? at::kByte : at::kChar));
  at::Tensor scale = at::empty({N}, src.options().dtype(at::kFloat));
  if (N == 0) return {q, scale};
  float* sp = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "pca_quantize_rows", [&] {
    const scalar_t* xp = src.const_data_ptr<scalar_t>();
    at::parallel_for(0, N, meshkern::grain(W), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const scalar_t* __restrict v = xp + rm(i) * W;
        float amax = 0.0f;
        for (int64_t j = 0; j < W; ++j) amax = std::max(amax, std::fabs(static_cast<float>(v[j])));
        float s = amax / qmax;
        s = s > 0.0f ? s : 1.0f;  // all-zero row: codes 0
        sp[i] = s;
        if (int4) {
          uint8_t* __restrict o = q.data_ptr<uint8_t>() + i * cw;
          for (int64_t b = 0; b < cw; ++b) {
            const int lo = static_cast<int>(quantize_one(static_cast<float>(v[2 * b]), s, qmax)) + 8;
            const int hi = 2 * b + 1 < W ? static_cast<int>(quantize_one(static_cast<float>(v[2 * b + 1]), s, qmax)) + 8
                                         : 8;  // odd W: the pad nibble
            o[b] = static_cast<uint8_t>(lo | (hi << 4));
          }
        } else {
          int8_t* __restrict o = q.data_ptr<int8_t>() + i * cw;
          for (int64_t j = 0; j < W; ++j) o[j] = static_cast<int8_t>(quantize_one(static_cast<float>(v[j]), s, qmax));
        }
      }
    });
  });
  return {q, scale};
}

void pca_decode_cpu(const at::Tensor& q_in, const at::Tensor& scale_in, const at::Tensor& norm_in,
                    const at::Tensor& U_in, const std::optional<at::Tensor>& mean_in, at::Tensor& out, int64_t N,
                    at::IntArrayRef rowmap, int64_t bits) {
  check_basis("pca_decode", U_in, norm_in, mean_in);
  TORCH_CHECK(bits == 4 || bits == 8, "pca_decode: bits must be 4 or 8, got ", bits);
  const RowMap rm = row_map(rowmap, "pca_decode");
  const int64_t H = U_in.size(0), k = U_in.size(1), cw = bits == 4 ? (k + 1) / 2 : k;
  TORCH_CHECK(q_in.dim() == 2 && q_in.size(0) == N && q_in.size(1) == cw, "pca_decode: q must be [N, ", cw, "]");
  TORCH_CHECK(scale_in.numel() == N && scale_in.scalar_type() == at::kFloat, "pca_decode: scale must be fp32 [N]");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == H && out.is_contiguous(), "pca_decode: out must be contiguous [rows, H]");
  TORCH_CHECK(last_row(rm, N) < out.size(0), "pca_decode: the row map reaches past out's rows");
  if (N == 0) return;
  const at::Tensor q = q_in.contiguous(), scale = scale_in.contiguous(), norm = norm_in.contiguous();
  const at::Tensor Ut = U_in.contiguous().t();
  std::optional<at::Tensor> mean;
  if (mean_in) mean = mean_in->contiguous();
  const float* mp = mean ? mean->const_data_ptr<float>() : nullptr;
  const float* np = norm.const_data_ptr<float>();
  const float* sp = scale.const_data_ptr<float>();
  const int64_t R = block_rows(std::max(H, k)), nblocks = (N + R - 1) / R;
  const auto fopts = out.options().dtype(at::kFloat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "pca_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      std::unique_ptr<float[]> cbuf(new float[static_cast<size_t>(R * k)]);
      at::Tensor hb = at::empty({R, H}, fopts);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t i0 = blk * R, rows = std::min(R, N - i0);
        for (int64_t r = 0; r < rows; ++r) {
          float* __restrict c = cbuf.get() + r * k;
          const float s = sp[i0 + r];
          if (bits == 4) {
            const uint8_t* __restrict b = q.const_data_ptr<uint8_t>() + (i0 + r) * cw;
            for (int64_t j = 0; j < k; ++j) {
              const int nib = (b[j >> 1] >> ((j & 1) * 4)) & 0xF;
              c[j] = (static_cast<float>(nib - 8) * s) * np[j];
            }
          } else {
            const int8_t* __restrict b = q.const_data_ptr<int8_t>() + (i0 + r) * cw;
            for (int64_t j = 0; j < k; ++j) c[j] = (static_cast<float>(b[j]) * s) * np[j];
          }
        }
        at::Tensor h = hb.narrow(0, 0, rows);
        at::mm_out(h, at::from_blob(cbuf.get(), {rows, k}, fopts), Ut);
        const float* hp = h.const_data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          scalar_t* __restrict o = op + rm(i0 + r) * H;
          const float* __restrict t = hp + r * H;
          if (mp != nullptr) {
            for (int64_t j = 0; j < H; ++j) o[j] = static_cast<scalar_t>(t[j] + mp[j]);
          } else {
            for (int64_t j = 0; j < H; ++j) o[j] = static_cast<scalar_t>(t[j]);
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("pca_project", &pca_project_cpu);
  m.impl("pca_quantize_rows", &pca_quantize_rows_cpu);
  m.impl("pca_decode", &pca_decode_cpu);
}
