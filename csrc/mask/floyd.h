// The mask's selection step, shared by the CPU (mask_cpu.cpp) and CUDA (mask_cuda.cu)
// kernels. The specification is meshkern/reference_mask.py; in short, for token row r:
// draw d (0 <= d < K) uses Philox block d/2 of counter (d/2, r, step, tag), words
// (w0, w1) for even d and (w2, w3) for odd d as a 64-bit uniform x = hi:lo, and
// t = floor(x * (j + 1) / 2^64) with j = H - K + d; Floyd's algorithm keeps t, or j if
// t is already kept. Kept dims are the set bits of a bitmap of 32-bit words.
#pragma once
#include "philox.h"

namespace meshkern {
namespace mask {

// Philox key/counter words that do not vary within one op call.
struct KeyWords {
  uint32_t k0, k1;  // seed & 0xffffffff, seed >> 32
  uint32_t step;    // optimizer step
  uint32_t tag;     // (boundary << 16) | microbatch
};

// floor((hi * 2^32 + lo) * n / 2^64): uniform on [0, n) with bias < 2^-64 per value.
MK_HD uint32_t draw_below(uint32_t hi, uint32_t lo, uint32_t n) {
  const uint64_t a = static_cast<uint64_t>(hi) * n;
  const uint64_t b = (static_cast<uint64_t>(lo) * n) >> 32;
  return static_cast<uint32_t>((a + b) >> 32);  // a + b < 2^64: no overflow
}

// The two draws of Philox block `blk` for row `row`: candidates t for d = 2*blk, 2*blk+1.
MK_HD void draw_pair(const KeyWords& key, uint32_t row, uint32_t H, uint32_t K, uint32_t blk,
                     uint32_t& t0, uint32_t& t1) {
  const Philox4x32 w = philox4x32_10(blk, row, key.step, key.tag, key.k0, key.k1);
  const uint32_t j = H - K + 2 * blk;
  t0 = draw_below(w.w0, w.w1, j + 1);
  t1 = draw_below(w.w2, w.w3, j + 2);  // unused when 2*blk + 1 == K
}

// Floyd's step for draw j with candidate t <= j: keep t, or j if t is already kept.
// Word is uint32_t (CUDA, shared memory) or uint64_t (CPU: half the scan iterations).
template <typename Word>
MK_HD void floyd_insert(Word* bits, uint32_t t, uint32_t j) {
  constexpr uint32_t kBits = 8 * sizeof(Word);
  const uint32_t c = ((bits[t / kBits] >> (t % kBits)) & 1u) ? j : t;
  bits[c / kBits] |= Word(1) << (c % kBits);
}

template <typename Word>
MK_HD uint32_t bitmap_words(uint32_t H) { return (H + 8 * sizeof(Word) - 1) / (8 * sizeof(Word)); }

}  // namespace mask
}  // namespace meshkern
