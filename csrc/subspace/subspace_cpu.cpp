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
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlockBytes = 256 * 1024;

int64_t block_rows(int64_t H, int64_t elem) {
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(1, H * elem), 8, 1024);
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

// dst[0..H) = (acc_t) base row for row `i` (E[ids[i]], offset, or zeros).
template <class scalar_t, class acc_t>
inline void load_base(acc_t* dst, int64_t i, int64_t H, const Base& b, const scalar_t* E, const scalar_t* off) {
  if (b.ids != nullptr) {
    const int64_t id = b.ids[i];
    TORCH_CHECK(id >= 0 && id < b.V, "subspace: id ", id, " outside [0, V=", b.V, ")");
    const scalar_t* e = E + id * H;
    for (int64_t j = 0; j < H; ++j) dst[j] = static_cast<acc_t>(e[j]);
  } else if (b.has_offset) {
    for (int64_t j = 0; j < H; ++j) dst[j] = static_cast<acc_t>(off[j]);
  } else {
    std::memset(dst, 0, sizeof(acc_t) * H);
  }
}

template <class scalar_t, class acc_t>
void encode_kernel(const at::Tensor& h, const Base& b, const scalar_t* E, const scalar_t* off, const at::Tensor& Ua,
                   at::Tensor& out) {
  const int64_t N = h.size(0), H = h.size(1);
  const int64_t R = block_rows(H, sizeof(acc_t));
  const int64_t nblocks = (N + R - 1) / R;
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const auto opts = out.options();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<acc_t> buf(static_cast<size_t>(R * H));
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * R, rows = std::min(R, N - r0);
      for (int64_t r = 0; r < rows; ++r) {
        acc_t* t = buf.data() + r * H;
        const scalar_t* hr = hp + (r0 + r) * H;
        load_base<scalar_t, acc_t>(t, r0 + r, H, b, E, off);
        for (int64_t j = 0; j < H; ++j) t[j] = static_cast<acc_t>(hr[j]) - t[j];
      }
      at::Tensor tb = at::from_blob(buf.data(), {rows, H}, opts);
      at::Tensor ob = out.narrow(0, r0, rows);
      at::mm_out(ob, tb, Ua);
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
      for (int64_t r = 0; r < rows; ++r) load_base<scalar_t, acc_t>(op + (r0 + r) * H, r0 + r, H, b, E, off);
      ob.addmm_(ca.narrow(0, r0, rows), Ut);
    }
  });
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor subspace_encode_cpu(const at::Tensor& h_in, const std::optional<at::Tensor>& ids_in,
                               const std::optional<at::Tensor>& E_in, const std::optional<at::Tensor>& off_in,
                               const at::Tensor& U) {
  check_common("subspace_encode", h_in, U.size(0), "H", ids_in, E_in, off_in, U);
  const at::Tensor h = h_in.contiguous();
  const auto acc = acc_type(h.scalar_type());
  const at::Tensor Ua = U.to(acc).contiguous();
  at::Tensor out = at::empty({h.size(0), U.size(1)}, h.options().dtype(acc));
  if (h.size(0) == 0) return out.to(h.scalar_type());
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "subspace_encode", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    encode_kernel<scalar_t, acc_t>(h, b, E ? E->const_data_ptr<scalar_t>() : nullptr,
                                   off ? off->const_data_ptr<scalar_t>() : nullptr, Ua, out);
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
