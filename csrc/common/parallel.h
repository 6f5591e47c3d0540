// Shared CPU parallel-loop sizing for the OpenMP kernels (at::parallel_for).
#pragma once

#include <algorithm>
#include <cstdint>

namespace meshkern {

// Rows per parallel chunk: ~32K units of work per chunk (ATen's GRAIN_SIZE idea), at
// least one row.
inline int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_row));
}

}  // namespace meshkern
