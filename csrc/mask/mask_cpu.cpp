// meshkern_C mask kernels: schemas (all devices) and the CPU implementations.
//
// Per token row: the K kept dims in ascending order (select_cpu.h: Philox, Floyd's K-step
// selection, ordering), which drive the gather (pack), the scatter (unpack) or the index
// write (indices) directly, so the fused ops write no index tensor. Rows are independent:
// at::parallel_for (OpenMP) splits them across torch's intra-op threads; the result does
// not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "mask_host.h"
#include "parallel.h"
#include "select_cpu.h"

namespace meshkern {
namespace mask {
namespace {

// Prefetches rows [row * stride, row * stride + bytes) of `base` (a null base: nothing).
struct RowPrefetch {
  const char* base = nullptr;
  int64_t stride = 0, bytes = 0;
  void operator()(int64_t row) const {
    if (base == nullptr) return;
    const char* p = base + row * stride;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
  }
};

// Runs the selection for every row (select_cpu.h: the CPU's fastest variant, all of them
// give the same dims) and calls visit(row, dim, k) for each kept dim of the row in
// ascending order (k = 0..K-1). prefetch(row + 1) is called before row's selection: the
// movers use it to pull the next row's memory into cache while the selection computes.
template <class Visit>
void for_each_kept(const KeyWords& key, int64_t N, uint32_t H, uint32_t K, Visit visit,
                   RowPrefetch prefetch = RowPrefetch{}) {
  // Below K = 4 the scalar code wins (one short Philox chain per row; measured crossover).
  const SelectRowFn select = select_row_fn(K < 4 ? 0 : active_isa());
  at::parallel_for(0, N, grain(H), [&](int64_t begin, int64_t end) {
    RowScratch scratch(H, K);
    const uint32_t* sorted = scratch.sorted.data();
    for (int64_t row = begin; row < end; ++row) {
      if (row + 1 < end) prefetch(row + 1);
      select(key, static_cast<uint32_t>(row), scratch);
      for (uint32_t k = 0; k < K; ++k) visit(row, sorted[k], k);
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
    // Every cache line of the next [H] row of h (pack) / of the output (unpack), before
    // this row's selection, except where the hardware prefetcher already streams the row:
    // at most one 4 KiB page and >= 3/4 of its cache lines holding a kept dim. Measured
    // (1 core, 4096 rows, H=2048, CPU time; a gather harness like
    // bench/mask_select_profile.cpp's): pack fp32 K=102 4.7 -> 2.8 ms, fp32 K=20 2.1 ->
    // 1.9, bf16 K=20 1.9 -> 1.0, fp32 H=4096 K=205 8.4 -> 6.8, and bf16 K=102 (one page,
    // 81% of lines) 1.55 -> 1.66, hence the exception; prefetching only the kept dims'
    // lines gave 4.0-4.1 on fp32 K=102, spreading the row's prefetches over the previous
    // row's gather 2.8. A row that spans pages stalls the hardware prefetcher at each page
    // crossing. (A lambda doing the same lost its prefetch instructions in GCC 12: a struct.)
    const int64_t row_bytes = H * static_cast<int64_t>(sizeof(scalar_t));
    const double untouched = std::pow(1.0 - double(K) / double(H), 64.0 / sizeof(scalar_t));
    RowPrefetch prefetch;
    if (!(row_bytes <= 4096 && 1.0 - untouched >= 0.75)) {
      prefetch = {reinterpret_cast<const char*>(kPack ? s : d), row_bytes, row_bytes};
    }
    auto run = [&](auto f) {
      for_each_kept(
          key, N, H, K,
          [&](int64_t row, uint32_t dim, uint32_t k) {
            if constexpr (kPack) {
              d[row * K + k] = f(s[row * H + dim]);
            } else {
              d[row * H + dim] = f(s[row * K + k]);
            }
          },
          prefetch);
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
  check_rows(h_in, "h", "[N, H]");
  const auto h = h_in.contiguous();
  const int64_t N = h.size(0), H = h.size(1);
  check_sizes(N, H, K);
  auto out = at::empty({N, K}, h.options());
  move_kept<true>(h, out, key_words(k0, k1, step, tag), N, H, K, scale, rescale);
  return out;
}

at::Tensor unpack_cpu(const at::Tensor& v_in, int64_t k0, int64_t k1, int64_t step, int64_t tag,
                      int64_t H, double scale, bool rescale) {
  check_rows(v_in, "v", "[N, K]");
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
  // The CPU selection variant the kernels use now: "avx512", "avx2" or "generic"
  // (MESHKERN_MASK_ISA caps it; select_cpu.h).
  m.def("mask_cpu_isa() -> str", [] { return std::string(meshkern::mask::isa_name(meshkern::mask::active_isa())); });
}

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("philox4x32", &meshkern::mask::philox4x32);
  m.impl("mask_indices", &meshkern::mask::indices_cpu);
  m.impl("mask_pack", &meshkern::mask::pack_cpu);
  m.impl("mask_unpack", &meshkern::mask::unpack_cpu);
}
