// meshkern_C::subspace_encode / subspace_decode on CPU tensors.
//
// encode: c = (h - E[ids]) @ U. The unfused torch chain (index_select, sub, matmul) writes
// E[ids] and h - E[ids] to memory ([N, H] each) and reads them back. Here the rows go
// in blocks of ~256 KiB of fp32 (L2-sized): a block's h - base is formed in a per-thread
// buffer and handed straight to the BLAS GEMM (at::mm_out into the block's rows of c),
// while it is still in cache. The GEMM itself is the BLAS's: a hand-written dot loop
// would run at the SSE2 width this extension is compiled for (no -march), the BLAS picks
// AVX2 / AVX-512 at run time.
//
// decode: h = E[ids] + c @ U^T. Per block, the base rows are copied into the output rows
// and the GEMM accumulates onto them (addmm_ with beta = 1), again while they are cached:
// no [N, H] temporary for c @ U^T and no separate add pass.
//
// encode with a projected table T = E U [V, k] (E is frozen, so a caller can keep T):
// c = h U - T[ids]: one GEMM on h itself, then the gathered k-wide rows of T subtracted
// from c (k values gathered per token instead of H; no [N, k] temporary for T[ids]).
//
// fp16 / bf16 inputs are widened to fp32 in the block buffer (fp64 stays fp64) and the
// result is rounded once at the end. Blocks are independent: at::parallel_for (OpenMP)
// splits them across torch's intra-op threads; each row's arithmetic does not depend on
// the thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlockBytes = 256 * 1024;

// Rows per parallel chunk for a row loop of `width` values (~32K values per chunk).
inline int64_t meshkern_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

int64_t block_rows(int64_t H, int64_t elem) {
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(1, H * elem), 8, 1 << 20);
}

struct Base {
  const int64_t* ids = nullptr;  // rows of E, or null
  int64_t V = 0;
  bool has_offset = false;
};

void check_common(const char* op, const at::Tensor& x, int64_t want_width, const char* width_name,
                  const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& E,
                  const std::optional<at::Tensor>& offset, const at::Tensor& U) {
  TORCH_CHECK(U.dim() == 2, op, ": U must be [H, k], got ", U.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == want_width, op, ": input must be [N, ", width_name, "=", want_width,
              "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == U.scalar_type(), op, ": U must have the input's dtype");
  TORCH_CHECK(ids.has_value() == E.has_value(), op, ": give ids and E together");
  TORCH_CHECK(!(E.has_value() && offset.has_value()), op, ": give ids/E or offset, not both");
  const int64_t H = U.size(0);
  if (E.has_value()) {
    TORCH_CHECK(ids->scalar_type() == at::kLong, op, ": ids must be int64");
    TORCH_CHECK(ids->dim() == 1 && ids->size(0) == x.size(0), op, ": ids must be [N=", x.size(0), "], got ",
                ids->sizes());
    TORCH_CHECK(E->dim() == 2 && E->size(1) == H, op, ": E must be [V, H=", H, "], got ", E->sizes());
    TORCH_CHECK(E->scalar_type() == x.scalar_type(), op, ": E must have the input's dtype");
  }
  if (offset.has_value()) {
    TORCH_CHECK(offset->dim() == 1 && offset->size(0) == H, op, ": offset must be [H=", H, "], got ",
                offset->sizes());
    TORCH_CHECK(offset->scalar_type() == x.scalar_type(), op, ": offset must have the input's dtype");
  }
}

// The base row of row `i`: E[ids[i]] (range-checked), the offset, or null (zero).
template <class scalar_t>
inline const scalar_t* base_row(int64_t i, int64_t H, const Base& b, const scalar_t* E, const scalar_t* off) {
  if (b.ids != nullptr) {
    const int64_t id = b.ids[i];
    TORCH_CHECK(id >= 0 && id < b.V, "subspace: id ", id, " outside [0, V=", b.V, ")");
    return E + id * H;
  }
  return b.has_offset ? off : nullptr;
}

// Pulls the E row of row `i` toward L2 a few rows ahead of its use: the rows of a large
// table (SmolLM2: 49152 x 576 fp32, 113 MB) are random DRAM accesses.
template <class scalar_t>
inline void prefetch_row(int64_t i, int64_t N, int64_t H, const Base& b, const scalar_t* E) {
  if (b.ids == nullptr || i >= N) return;
  const int64_t id = b.ids[i];
  if (id < 0 || id >= b.V) return;
  const char* p = reinterpret_cast<const char*>(E + id * H);
  for (int64_t off = 0; off < H * static_cast<int64_t>(sizeof(scalar_t)); off += 64) __builtin_prefetch(p + off, 0, 1);
}

constexpr int64_t kAhead = 4;  // rows of E prefetched ahead

template <class scalar_t, class acc_t>
void encode_kernel(const at::Tensor& h, const Base& b, const scalar_t* E, const scalar_t* off, const scalar_t* table,
                   const at::Tensor& Ua, at::Tensor& out) {
  const int64_t N = h.size(0), H = h.size(1), k = Ua.size(1);
  const int64_t R = block_rows(H, sizeof(acc_t));
  const int64_t nblocks = (N + R - 1) / R;
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const auto opts = out.options();
  constexpr bool same = std::is_same_v<scalar_t, acc_t>;
  if (table != nullptr) {
    // c = h U - T[ids]: one GEMM over all rows (one BLAS call beats row blocks here: the
    // k-wide epilogue needs no cache blocking), then the gathered T rows subtracted.
    if constexpr (same) {
      at::mm_out(out, h, Ua);
    } else {
      at::mm_out(out, h.to(Ua.scalar_type()), Ua);
    }
    acc_t* cp = out.data_ptr<acc_t>();
    at::parallel_for(0, N, meshkern_grain(k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t id = b.ids[r];
        TORCH_CHECK(id >= 0 && id < b.V, "subspace: id ", id, " outside [0, V=", b.V, ")");
        const scalar_t* __restrict tr = table + id * k;
        acc_t* __restrict cr = cp + r * k;
        for (int64_t j = 0; j < k; ++j) cr[j] -= static_cast<acc_t>(tr[j]);
      }
    });
    return;
  }
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    std::unique_ptr<acc_t[]> buf;  // uninitialized: every element is written before the GEMM reads it
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * R, rows = std::min(R, N - r0);
      at::Tensor ob = out.narrow(0, r0, rows);
      if (same && b.ids == nullptr && !b.has_offset) {  // no base: the GEMM on h itself
        at::mm_out(ob, h.narrow(0, r0, rows), Ua);
        continue;
      }
      if (!buf) buf.reset(new acc_t[static_cast<size_t>(R * H)]);
      for (int64_t r = 0; r < std::min(kAhead, rows); ++r) prefetch_row(r0 + r, N, H, b, E);
      for (int64_t r = 0; r < rows; ++r) {
        prefetch_row(r0 + r + kAhead, N, H, b, E);
        acc_t* __restrict t = buf.get() + r * H;
        const scalar_t* __restrict hr = hp + (r0 + r) * H;
        const scalar_t* __restrict e = base_row(r0 + r, H, b, E, off);
        if (e != nullptr) {
          for (int64_t j = 0; j < H; ++j) t[j] = static_cast<acc_t>(hr[j]) - static_cast<acc_t>(e[j]);
        } else {
          for (int64_t j = 0; j < H; ++j) t[j] = static_cast<acc_t>(hr[j]);
        }
      }
      at::mm_out(ob, at::from_blob(buf.get(), {rows, H}, opts), Ua);
    }
  });
}

template <class scalar_t, class acc_t>
void decode_kernel(const at::Tensor& ca, const Base& b, const scalar_t* E, const scalar_t* off, const at::Tensor& Ua,
                   at::Tensor& out) {
  const int64_t N = ca.size(0), H = Ua.size(0);
  const int64_t R = block_rows(H, sizeof(acc_t));
  const int64_t nblocks = (N + R - 1) / R;
  const at::Tensor Ut = Ua.t();
  acc_t* op = out.data_ptr<acc_t>();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * R, rows = std::min(R, N - r0);
      at::Tensor ob = out.narrow(0, r0, rows);
      if (b.ids == nullptr && !b.has_offset) {
        at::mm_out(ob, ca.narrow(0, r0, rows), Ut);
        continue;
      }
      for (int64_t r = 0; r < std::min(kAhead, rows); ++r) prefetch_row(r0 + r, N, H, b, E);
      for (int64_t r = 0; r < rows; ++r) {
        prefetch_row(r0 + r + kAhead, N, H, b, E);
        const scalar_t* __restrict e = base_row(r0 + r, H, b, E, off);
        acc_t* __restrict o = op + (r0 + r) * H;
        if constexpr (std::is_same_v<scalar_t, acc_t>) {
          std::memcpy(o, e, sizeof(acc_t) * H);
        } else {
          for (int64_t j = 0; j < H; ++j) o[j] = static_cast<acc_t>(e[j]);
        }
      }
      ob.addmm_(ca.narrow(0, r0, rows), Ut);
    }
  });
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor subspace_encode_cpu(const at::Tensor& h_in, const std::optional<at::Tensor>& ids_in,
                               const std::optional<at::Tensor>& E_in, const std::optional<at::Tensor>& off_in,
                               const std::optional<at::Tensor>& table_in, const at::Tensor& U) {
  if (table_in.has_value()) {
    TORCH_CHECK(ids_in.has_value() && !E_in.has_value() && !off_in.has_value(),
                "subspace_encode: table replaces E: give ids and table only");
    TORCH_CHECK(table_in->dim() == 2 && table_in->size(1) == U.size(1), "subspace_encode: table must be [V, k=",
                U.size(1), "], got ", table_in->sizes());
    TORCH_CHECK(table_in->scalar_type() == h_in.scalar_type(), "subspace_encode: table must have h's dtype");
    check_common("subspace_encode", h_in, U.size(0), "H", std::nullopt, std::nullopt, std::nullopt, U);
    TORCH_CHECK(ids_in->scalar_type() == at::kLong && ids_in->dim() == 1 && ids_in->size(0) == h_in.size(0),
                "subspace_encode: ids must be int64 [N=", h_in.size(0), "]");
  } else {
    check_common("subspace_encode", h_in, U.size(0), "H", ids_in, E_in, off_in, U);
  }
  const at::Tensor h = h_in.contiguous();
  const auto acc = acc_type(h.scalar_type());
  const at::Tensor Ua = U.to(acc).contiguous();
  at::Tensor out = at::empty({h.size(0), U.size(1)}, h.options().dtype(acc));
  if (h.size(0) == 0) return out.to(h.scalar_type());
  std::optional<at::Tensor> ids, E, off, table;
  Base b;
  if (E_in.has_value() || table_in.has_value()) {
    ids = ids_in->contiguous();
    b.ids = ids->const_data_ptr<int64_t>();
  }
  if (E_in.has_value()) {
    E = E_in->contiguous();
    b.V = E->size(0);
  }
  if (table_in.has_value()) {
    table = table_in->contiguous();
    b.V = table->size(0);
  }
  if (off_in.has_value()) {
    off = off_in->contiguous();
    b.has_offset = true;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "subspace_encode", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    encode_kernel<scalar_t, acc_t>(h, b, E ? E->const_data_ptr<scalar_t>() : nullptr,
                                   off ? off->const_data_ptr<scalar_t>() : nullptr,
                                   table ? table->const_data_ptr<scalar_t>() : nullptr, Ua, out);
  });
  return out.scalar_type() == h.scalar_type() ? out : out.to(h.scalar_type());
}

at::Tensor subspace_decode_cpu(const at::Tensor& c_in, const std::optional<at::Tensor>& ids_in,
                               const std::optional<at::Tensor>& E_in, const std::optional<at::Tensor>& off_in,
                               const at::Tensor& U) {
  check_common("subspace_decode", c_in, U.size(1), "k", ids_in, E_in, off_in, U);
  const auto acc = acc_type(c_in.scalar_type());
  const at::Tensor ca = c_in.to(acc).contiguous();
  const at::Tensor Ua = U.to(acc).contiguous();
  at::Tensor out = at::empty({c_in.size(0), U.size(0)}, c_in.options().dtype(acc));
  if (c_in.size(0) == 0) return out.to(c_in.scalar_type());
  std::optional<at::Tensor> ids, E, off;
  Base b;
  if (E_in.has_value()) {
    ids = ids_in->contiguous();
    E = E_in->contiguous();
    b.ids = ids->const_data_ptr<int64_t>();
    b.V = E->size(0);
  }
  if (off_in.has_value()) {
    off = off_in->contiguous();
    b.has_offset = true;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c_in.scalar_type(), "subspace_decode", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    decode_kernel<scalar_t, acc_t>(ca, b, E ? E->const_data_ptr<scalar_t>() : nullptr,
                                   off ? off->const_data_ptr<scalar_t>() : nullptr, Ua, out);
  });
  return out.scalar_type() == c_in.scalar_type() ? out : out.to(c_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(meshkern_C, CPU, m) {
  m.impl("subspace_encode", &subspace_encode_cpu);
  m.impl("subspace_decode", &subspace_decode_cpu);
}
