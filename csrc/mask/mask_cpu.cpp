// meshkern_C mask kernels: schemas (all devices) and the CPU implementations.
//
// Per token row: zero a bitmap of H bits, run Floyd's K-step selection (floyd.h), then
// scan the bitmap's set bits in ascending order; the scan drives the gather (pack),
// the scatter (unpack) or the index write (indices) directly, so the fused ops write no
// index tensor. Rows are independent: at::parallel_for (OpenMP) splits them across
// torch's intra-op threads; the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "mask_host.h"
#include "parallel.h"

namespace meshkern {
namespace mask {
namespace {

// Runs Floyd's selection for every row and calls visit(row, dim, k) for each kept dim
// of the row in ascending order (k = 0..K-1).
template <class Visit>
void for_each_kept(const KeyWords& key, int64_t N, uint32_t H, uint32_t K, Visit visit) {
  at::parallel_for(0, N, grain(H), [&](int64_t begin, int64_t end) {
    const uint32_t nwords = bitmap_words<uint64_t>(H), nblocks = (K + 1) / 2;
    std::vector<uint64_t> bits(nwords);
    std::vector<uint32_t> cand(2 * nblocks);
    uint32_t* cd = cand.data();
    for (int64_t row = begin; row < end; ++row) {
      const uint32_t r = static_cast<uint32_t>(row);
      // All Philox blocks first: independent iterations, vectorized with omp simd
      // (measured 2.2 -> 1.4 ms for 4096 x 51 blocks on SSE2).
#pragma omp simd
      for (uint32_t b = 0; b < nblocks; ++b) draw_pair(key, r, H, K, b, cd[2 * b], cd[2 * b + 1]);
      std::memset(bits.data(), 0, nwords * sizeof(uint64_t));
      for (uint32_t d = 0; d < K; ++d) floyd_insert(bits.data(), cd[d], H - K + d);
      uint32_t k = 0;
      for (uint32_t w = 0; w < nwords; ++w) {
        for (uint64_t word = bits[w]; word; word &= word - 1) visit(row, w * 64 + __builtin_ctzll(word), k++);
      }
    }
  });
}

at::Tensor philox4x32(const at::Tensor& counters, int64_t k0, int64_t k1) {
  TORCH_CHECK(counters.dim() == 2 && counters.size(1) == 4 && counters.scalar_type() == at::kLong,
              "counters must be int64 [N, 4]");
  const KeyWords key = key_words(k0, k1, 0, 0);
  auto c = counters.contiguous();
  auto out = at::empty_like(c);
  const int64_t* in = c.const_data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.size(0); ++i) {
    const int64_t* x = in + 4 * i;
    const Philox4x32 w = philox4x32_10(uint32_t(x[0]), uint32_t(x[1]), uint32_t(x[2]), uint32_t(x[3]),
                                       key.k0, key.k1);
    o[4 * i] = w.w0; o[4 * i + 1] = w.w1; o[4 * i + 2] = w.w2; o[4 * i + 3] = w.w3;
  }
  return out;
}

void indices_cpu(at::Tensor& out, int64_t k0, int64_t k1, int64_t step, int64_t tag, int64_t H) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kLong && out.is_contiguous(),
              "out must be a contiguous int64 [N, K] tensor");
  const int64_t N = out.size(0), K = out.size(1);
  check_sizes(N, H, K);
  int64_t* o = out.data_ptr<int64_t>();
  for_each_kept(key_words(k0, k1, step, tag), N, H, K,
                [&](int64_t row, uint32_t dim, uint32_t k) { o[row * K + k] = dim; });
}

// Moves the kept values between a [N, H] and a [N, K] tensor: kPack gathers h -> out,
// otherwise scatters v -> out (already zero). rescale multiplies by `scale` in opmath
// (float for half types), rounding once to the output dtype.
template <bool kPack>
void move_kept(const at::Tensor& src, at::Tensor& out, const KeyWords& key, int64_t N, int64_t H, int64_t K,
               double scale, bool rescale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "mask_move_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* s = src.const_data_ptr<scalar_t>();
    scalar_t* d = out.data_ptr<scalar_t>();
    auto run = [&](auto f) {
      for_each_kept(key, N, H, K, [&](int64_t row, uint32_t dim, uint32_t k) {
        if constexpr (kPack) {
          d[row * K + k] = f(s[row * H + dim]);
        } else {
          d[row * H + dim] = f(s[row * K + k]);
        }
      });
    };
    if (rescale) {
      const opmath_t m = static_cast<opmath_t>(scale);
      run([m](scalar_t x) { return static_cast<scalar_t>(static_cast<opmath_t>(x) * m); });
    } else {
      run([](scalar_t x) { return x; });
    }
  });
}

at::Tensor pack_cpu(const at::Tensor& h_in, int64_t k0, int64_t k1, int64_t step, int64_t tag,
                    int64_t K, double scale, bool rescale) {
  TORCH_CHECK(h_in.dim() == 2, "h must be [N, H]");
  TORCH_CHECK(at::isFloatingType(h_in.scalar_type()), "h must be a floating tensor, got ", h_in.scalar_type());
  const auto h = h_in.contiguous();
  const int64_t N = h.size(0), H = h.size(1);
  check_sizes(N, H, K);
  auto out = at::empty({N, K}, h.options());
  move_kept<true>(h, out, key_words(k0, k1, step, tag), N, H, K, scale, rescale);
  return out;
}

at::Tensor unpack_cpu(const at::Tensor& v_in, int64_t k0, int64_t k1, int64_t step, int64_t tag,
                      int64_t H, double scale, bool rescale) {
  TORCH_CHECK(v_in.dim() == 2, "v must be [N, K]");
  TORCH_CHECK(at::isFloatingType(v_in.scalar_type()), "v must be a floating tensor, got ", v_in.scalar_type());
  const auto v = v_in.contiguous();
  const int64_t N = v.size(0), K = v.size(1);
  check_sizes(N, H, K);
  // One big zero fill, then the scatter. Measured (CPU time, 1 thread, [4096, 2048]
  // fp32): 1.26x torch.zeros, vs 1.48x when zeroing each row just before its scatter
  // (the large fill streams; row-sized fills do not).
  auto out = at::zeros({N, H}, v.options());
  move_kept<false>(v, out, key_words(k0, k1, step, tag), N, H, K, scale, rescale);
  return out;
}

}  // namespace
}  // namespace mask
}  // namespace meshkern

// Internal kernels; the public ops are meshkern::mask_* (meshkern/mask.py).
// mask_indices writes into `out` so that it dispatches on out's device.
TORCH_LIBRARY_FRAGMENT(meshkern_C, m) {
  m.def("philox4x32(Tensor counters, int k0, int k1) -> Tensor");
  m.def("mask_indices(Tensor(a!) out, int k0, int k1, int step, int tag, int H) -> ()");
  m.def("mask_pack(Tensor h, int k0, int k1, int step, int tag, int K, float scale, bool rescale) -> Tensor");
  m.def("mask_unpack(Tensor v, int k0, int k1, int step, int tag, int H, float scale, bool rescale) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("philox4x32", &meshkern::mask::philox4x32);
  m.impl("mask_indices", &meshkern::mask::indices_cpu);
  m.impl("mask_pack", &meshkern::mask::pack_cpu);
  m.impl("mask_unpack", &meshkern::mask::unpack_cpu);
}
