// meshkern_C::pca_nf_pack / pca_nf_unpack on CPU tensors: the elementwise part of the
// pca:quant=nf codec (the spec is meshkern/pca_nf.py's reference; the GEMMs stay torch's).
//
// pack: per row of z [N, k] (the coordinates divided by the token's scale), every
// coordinate with b_i > 0 bits gets the number of its code book's boundaries below it (a
// binary search over at most 255 sorted values: what torch.searchsorted does, NaN counted
// as above every boundary as torch counts it), and the b_i-bit code is appended to the
// row's bit stream, least significant bit first, through a 64-bit accumulator flushed a
// byte at a time. Comparisons only: the codes are the reference's bit for bit.
// unpack: the inverse stream walk, and z_hat_i = levels[i, code_i] (0 for b_i = 0).
// Rows are independent: at::parallel_for splits them across torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "parallel.h"

namespace {

void check_tables(const char* op, const at::Tensor& table, const at::Tensor& bits, int64_t k, int64_t extra) {
  TORCH_CHECK(bits.dim() == 1 && bits.size(0) == k && bits.scalar_type() == at::kLong && bits.is_contiguous(), op,
              ": bits must be a contiguous int64 [k]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == k && table.scalar_type() == at::kFloat && table.is_contiguous(),
              op, ": the code book table must be a contiguous fp32 [k, 2^max_bits", extra ? " - 1" : "", "]");
  const int64_t* b = bits.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(b[i] >= 0 && b[i] <= 8 && (int64_t(1) << b[i]) - extra <= table.size(1), op,
                ": code width ", b[i], " of coordinate ", i, " does not fit the table");
  }
}

int64_t total_bits(const at::Tensor& bits) {
  const int64_t* b = bits.data_ptr<int64_t>();
  int64_t t = 0;
  for (int64_t i = 0; i < bits.size(0); ++i) t += b[i];
  return t;
}

at::Tensor pca_nf_pack_cpu(const at::Tensor& z, const at::Tensor& bounds, const at::Tensor& bits, int64_t nbytes) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.is_contiguous() && z.device().is_cpu(),
              "pca_nf_pack: z must be a contiguous fp32 CPU [N, k]");
  const int64_t N = z.size(0), k = z.size(1);
  check_tables("pca_nf_pack", bounds, bits, k, 1);
  TORCH_CHECK(total_bits(bits) <= 8 * nbytes, "pca_nf_pack: ", total_bits(bits), " bits do not fit ", nbytes, " bytes");
  auto out = at::zeros({N, nbytes}, z.options().dtype(at::kByte));
  const float* zp = z.data_ptr<float>();
  const float* bp = bounds.data_ptr<float>();
  const int64_t* wp = bits.data_ptr<int64_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t stride = bounds.size(1);
  at::parallel_for(0, N, meshkern::grain(k * 8), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = zp + r * k;
      uint8_t* dst = op + r * nbytes;
      uint64_t acc = 0;
      int fill = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int b = static_cast<int>(wp[i]);
        if (b == 0) continue;
        const float v = row[i];
        const float* bd = bp + i * stride;
        int64_t n = (int64_t(1) << b) - 1;  // boundaries of this width
        uint64_t code;
        if (std::isnan(v)) {
          code = static_cast<uint64_t>(n);
        } else {  // count of boundaries < v (searchsorted, side left)
          int64_t lo = 0, hi = n;
          while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (bd[mid] < v) lo = mid + 1; else hi = mid;
          }
          code = static_cast<uint64_t>(lo);
        }
        acc |= code << fill;
        fill += b;
        while (fill >= 8) {
          *dst++ = static_cast<uint8_t>(acc & 0xFF);
          acc >>= 8;
          fill -= 8;
        }
      }
      if (fill > 0) *dst = static_cast<uint8_t>(acc & 0xFF);
    }
  });
  return out;
}

at::Tensor pca_nf_unpack_cpu(const at::Tensor& packed, const at::Tensor& levels, const at::Tensor& bits) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.device().is_cpu(), "pca_nf_unpack: packed must be a contiguous uint8 CPU [N, nbytes]");
  const int64_t k = bits.size(0), N = packed.size(0), nbytes = packed.size(1);
  check_tables("pca_nf_unpack", levels, bits, k, 0);
  TORCH_CHECK(total_bits(bits) <= 8 * nbytes, "pca_nf_unpack: ", total_bits(bits), " bits need more than ", nbytes,
              " bytes");
  auto out = at::empty({N, k}, levels.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* lp = levels.data_ptr<float>();
  const int64_t* wp = bits.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t stride = levels.size(1);
  at::parallel_for(0, N, meshkern::grain(k * 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = pp + r * nbytes;
      const uint8_t* end = src + nbytes;
      float* row = o + r * k;
      uint64_t acc = 0;
      int fill = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int b = static_cast<int>(wp[i]);
        if (b == 0) {
          row[i] = 0.0f;
          continue;
        }
        while (fill < b && src < end) {
          acc |= static_cast<uint64_t>(*src++) << fill;
          fill += 8;
        }
        const uint64_t code = acc & ((uint64_t(1) << b) - 1);
        acc >>= b;
        fill -= b;
        row[i] = lp[i * stride + static_cast<int64_t>(code)];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("pca_nf_pack", &pca_nf_pack_cpu);
  m.impl("pca_nf_unpack", &pca_nf_unpack_cpu);
}
