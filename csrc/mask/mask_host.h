// Host-side argument checks shared by the CPU (mask_cpu.cpp) and CUDA (mask_cuda.cu)
// wrappers. The Python ops (meshkern/mask.py) validate first with clearer messages;
// these keep the raw meshkern_C kernels safe when called directly.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "floyd.h"

namespace meshkern {
namespace mask {

inline KeyWords key_words(int64_t k0, int64_t k1, int64_t step, int64_t tag) {
  const int64_t lim = int64_t(1) << 32;
  TORCH_CHECK(k0 >= 0 && k0 < lim && k1 >= 0 && k1 < lim && step >= 0 && step < lim && tag >= 0 && tag < lim,
              "malformed key: every key word must be in [0, 2**32)");
  return {static_cast<uint32_t>(k0), static_cast<uint32_t>(k1), static_cast<uint32_t>(step),
          static_cast<uint32_t>(tag)};
}

// The input of pack ([N, H]) or unpack ([N, K]): 2-D and floating point.
inline void check_rows(const at::Tensor& t, const char* name, const char* shape) {
  TORCH_CHECK(t.dim() == 2, name, " must be ", shape);
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name, " must be a floating tensor, got ", t.scalar_type());
}

inline void check_sizes(int64_t N, int64_t H, int64_t K) {
  TORCH_CHECK(H >= 1 && H < (int64_t(1) << 31), "H=", H, " must be in [1, 2**31)");
  TORCH_CHECK(K >= 1 && K <= H, "K=", K, " must be in [1, H=", H, "]");
  TORCH_CHECK(N <= (int64_t(1) << 32), "N=", N, " token rows exceed the 2**32 row counter");
}

}  // namespace mask
}  // namespace meshkern
