// meshkern_C mask kernels for CUDA tensors (schemas are in mask_cpu.cpp).
//
// One warp per token row, its bitmap (H bits) in shared memory:
//  1. the 32 lanes compute Philox blocks in parallel (two draws each, floyd.h);
//  2. lane 0 runs Floyd's sequential steps on the bitmap, taking the candidates from
//     the other lanes with __shfl_sync (a shared-memory read-modify-write per draw);
//  3. the warp scans the bitmap 32 words at a time: popcount + warp prefix sum give
//     every set bit its output slot, which drives the gather (pack), the scatter
//     (unpack, after the warp zeroed the row) or the index store directly.
// The result is the spec's (meshkern/reference_mask.py), whatever the launch shape.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mask_host.h"

namespace meshkern {
namespace mask {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxRowsPerBlock = 8;         // warps (token rows) per block
constexpr int64_t kSharedBytes = 48 * 1024;  // default dynamic shared memory limit

// Kept-dim bitmap of `row` into shared `bits` (nwords words). Whole warp calls it.
__device__ void select_row(uint32_t* bits, uint32_t nwords, const KeyWords& key, uint32_t row,
                           uint32_t H, uint32_t K, unsigned lane) {
  for (uint32_t w = lane; w < nwords; w += 32) bits[w] = 0;
  __syncwarp();
  const uint32_t nblocks = (K + 1) / 2;
  for (uint32_t b0 = 0; b0 < nblocks; b0 += 32) {
    uint32_t t0 = 0, t1 = 0;
    if (b0 + lane < nblocks) draw_pair(key, row, H, K, b0 + lane, t0, t1);
    const uint32_t n = min(32u, nblocks - b0);
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t a = __shfl_sync(kFullMask, t0, i);
      const uint32_t b = __shfl_sync(kFullMask, t1, i);
      if (lane == 0) {
        const uint32_t d = 2 * (b0 + i);
        floyd_insert(bits, a, H - K + d);
        if (d + 1 < K) floyd_insert(bits, b, H - K + d + 1);
      }
    }
  }
  __syncwarp();  // lane 0's bitmap writes are visible to the whole warp
}

// Calls visit(dim, k) for the k-th kept dim (ascending k); lanes share the work.
template <class Visit>
__device__ void scan_row(const uint32_t* bits, uint32_t nwords, unsigned lane, Visit visit) {
  uint32_t before = 0;  // kept dims in earlier rounds
  for (uint32_t w0 = 0; w0 < nwords; w0 += 32) {
    const uint32_t w = w0 + lane;
    uint32_t word = w < nwords ? bits[w] : 0u;
    const uint32_t count = __popc(word);
    uint32_t incl = count;  // inclusive prefix sum of counts over lanes
    for (unsigned off = 1; off < 32; off <<= 1) {
      const uint32_t y = __shfl_up_sync(kFullMask, incl, off);
      if (lane >= off) incl += y;
    }
    uint32_t k = before + incl - count;
    for (; word; word &= word - 1) visit(w * 32 + __ffs(word) - 1, k++);
    before += __shfl_sync(kFullMask, incl, 31);
  }
}

struct Launch {
  dim3 grid, block;
  size_t shared;
  uint32_t nwords;
};

Launch launch_shape(int64_t N, int64_t H) {
  const uint32_t nwords = bitmap_words<uint32_t>(static_cast<uint32_t>(H));
  const int64_t row_bytes = int64_t(nwords) * 4;
  TORCH_CHECK(row_bytes <= kSharedBytes, "the CUDA mask kernels support H <= ", kSharedBytes * 8,
              " (got H=", H, "); use backend='triton'");
  const int rows = static_cast<int>(std::min<int64_t>(kMaxRowsPerBlock, kSharedBytes / row_bytes));
  return {dim3(static_cast<unsigned>((N + rows - 1) / rows)), dim3(rows * 32),
          static_cast<size_t>(rows * row_bytes), nwords};
}

// Common prologue: this thread's row, lane and the row's bitmap; false if past N.
__device__ bool row_setup(int64_t N, uint32_t nwords, int64_t& row, unsigned& lane, uint32_t*& bits) {
  extern __shared__ uint32_t smem[];
  const unsigned warp = threadIdx.x / 32;
  lane = threadIdx.x % 32;
  row = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  bits = smem + warp * nwords;
  return row < N;  // uniform within a warp: no divergent __syncwarp
}

__global__ void indices_kernel(int64_t* __restrict__ out, int64_t N, uint32_t H, uint32_t K, uint32_t nwords,
                               KeyWords key) {
  int64_t row; unsigned lane; uint32_t* bits;
  if (!row_setup(N, nwords, row, lane, bits)) return;
  select_row(bits, nwords, key, static_cast<uint32_t>(row), H, K, lane);
  int64_t* dst = out + row * K;
  scan_row(bits, nwords, lane, [&](uint32_t dim, uint32_t k) { dst[k] = dim; });
}

// kPack: gather h [N, H] -> out [N, K]; else scatter v [N, K] -> out [N, H] (the warp
// zeroes its row first; select_row's __syncwarp orders the zeros before the scatter).
template <typename scalar_t, bool kRescale, bool kPack>
__global__ void move_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ out, int64_t N, uint32_t H,
                            uint32_t K, uint32_t nwords, KeyWords key, at::opmath_type<scalar_t> scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  int64_t row; unsigned lane; uint32_t* bits;
  if (!row_setup(N, nwords, row, lane, bits)) return;
  const scalar_t* s = src + row * (kPack ? H : K);
  scalar_t* d = out + row * (kPack ? K : H);
  if (!kPack) {
    for (uint32_t i = lane; i < H; i += 32) d[i] = scalar_t(0);
  }
  select_row(bits, nwords, key, static_cast<uint32_t>(row), H, K, lane);
  scan_row(bits, nwords, lane, [&](uint32_t dim, uint32_t k) {
    const scalar_t x = s[kPack ? dim : k];
    d[kPack ? k : dim] = kRescale ? static_cast<scalar_t>(static_cast<opmath_t>(x) * scale) : x;
  });
}

void indices_cuda(at::Tensor& out, int64_t k0, int64_t k1, int64_t step, int64_t tag, int64_t H) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kLong && out.is_contiguous(),
              "out must be a contiguous int64 [N, K] tensor");
  const int64_t N = out.size(0), K = out.size(1);
  check_sizes(N, H, K);
  if (N == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const Launch l = launch_shape(N, H);
  indices_kernel<<<l.grid, l.block, l.shared, c10::cuda::getCurrentCUDAStream()>>>(
      out.data_ptr<int64_t>(), N, H, K, l.nwords, key_words(k0, k1, step, tag));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kPack>
void move_cuda(const at::Tensor& src, at::Tensor& out, const KeyWords& key, int64_t N, int64_t H, int64_t K,
               double scale, bool rescale) {
  if (N == 0) return;
  const Launch l = launch_shape(N, H);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "mask_move_cuda", [&] {
    const auto m = static_cast<at::opmath_type<scalar_t>>(scale);
    auto kernel = rescale ? move_kernel<scalar_t, true, kPack> : move_kernel<scalar_t, false, kPack>;
    kernel<<<l.grid, l.block, l.shared, stream>>>(src.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, H, K,
                                                  l.nwords, key, m);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor pack_cuda(const at::Tensor& h_in, int64_t k0, int64_t k1, int64_t step, int64_t tag, int64_t K,
                     double scale, bool rescale) {
  check_rows(h_in, "h", "[N, H]");
  c10::cuda::CUDAGuard guard(h_in.device());
  const auto h = h_in.contiguous();
  const int64_t N = h.size(0), H = h.size(1);
  check_sizes(N, H, K);
  auto out = at::empty({N, K}, h.options());
  move_cuda<true>(h, out, key_words(k0, k1, step, tag), N, H, K, scale, rescale);
  return out;
}

at::Tensor unpack_cuda(const at::Tensor& v_in, int64_t k0, int64_t k1, int64_t step, int64_t tag, int64_t H,
                       double scale, bool rescale) {
  check_rows(v_in, "v", "[N, K]");
  c10::cuda::CUDAGuard guard(v_in.device());
  const auto v = v_in.contiguous();
  const int64_t N = v.size(0), K = v.size(1);
  check_sizes(N, H, K);
  auto out = at::empty({N, H}, v.options());  // the kernel zeroes each row
  move_cuda<false>(v, out, key_words(k0, k1, step, tag), N, H, K, scale, rescale);
  return out;
}

}  // namespace
}  // namespace mask
}  // namespace meshkern

TORCH_LIBRARY_IMPL(meshkern_C, CUDA, m) {
  m.impl("mask_indices", &meshkern::mask::indices_cuda);
  m.impl("mask_pack", &meshkern::mask::pack_cuda);
  m.impl("mask_unpack", &meshkern::mask::unpack_cuda);
}
