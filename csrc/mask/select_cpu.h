// The mask's per-row selection on CPU: the K kept dims of one token row, ascending.
// Same arithmetic as floyd.h (the spec: meshkern/reference_mask.py); three variants that
// return identical dims, chosen at run time from the CPU's features (mask_cpu_isa()):
//
//   avx512  Philox4x32-10 on 16 blocks per vector (AVX-512F/BW), Floyd on a byte map,
//           rank ordering
//   avx2    the same on 8 blocks per vector (AVX2)
//   generic the portable code: omp-simd Philox (the compiler's default ISA, SSE2 on
//           x86-64), Floyd on a bitmap, bitmap scan; also used for K < 4 rows
//
// Why (profile of the old generic path, T=4096 rows, H=2048, K=102, 1 core, ms; harness
// bench/mask_select_profile.cpp): Philox 1.42, Floyd 0.54, bitmap scan 1.19 (each 64-bit
// word's `while (word)` loop exit is a branch miss: ~32 per row), index writes ~0.
//   - The vector Philox computes a round's 32x32 -> 64 products with two vpmuludq (even /
//     odd lanes), recombines hi / lo with blends, and runs up to four independent vectors
//     (64 blocks) per pass so the serial round chains overlap.
//   - Floyd on a byte map: a load, a select and a plain store per draw, no shifts or
//     read-modify-write; the map is packed into 64-bit words afterwards (one vector
//     compare per 64 dims).
//   - The scan becomes a branch-free rank computation: Floyd records the dim it keeps at
//     each draw, and that dim's rank among the kept ones is the popcount of the bitmap
//     below it (a prefix sum over the words plus one masked popcount), so
//     `sorted[rank] = dim` orders the row without looking at the zero bits.
// After: Philox 0.51, Floyd 0.42, packing 0.06, ranks 0.34 (avx512, same harness, a busy
// machine). Timings of the ops: docs/benchmarks.md, "Mask".
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "floyd.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MESHKERN_MASK_SIMD 1
#endif

// bench/mask_select_profile.cpp compiles this header with MESHKERN_SELECT_PROFILE to stop a
// vector variant after a phase (0: Philox, 1: Floyd, 2: packing the byte map); nothing
// otherwise.
#ifdef MESHKERN_SELECT_PROFILE
#define MESHKERN_PROFILE_STOP(phase) \
  if (::meshkern::mask::profile_stop == (phase)) return;
#else
#define MESHKERN_PROFILE_STOP(phase)
#endif

namespace meshkern {
namespace mask {

#ifdef MESHKERN_SELECT_PROFILE
inline int profile_stop = -1;
#endif

// Per-thread scratch of one row's selection, sized for (H, K).
struct RowScratch {
  uint32_t H, K, nblocks, nwords;
  std::vector<uint32_t> te, to;      // candidates t of the even / odd draw of each block
  std::vector<uint64_t> bits;        // Floyd's bitmap (generic) / the kept bytes' bitmap
  std::vector<uint8_t> kept;         // vector variants: one byte per dim, 0x80 = kept
  std::vector<uint32_t> chosen;      // the dim kept at draw d
  std::vector<uint32_t> pre;         // kept dims in words [0, w)
  std::vector<uint32_t> sorted;      // the row's kept dims, ascending (the output)
  RowScratch(uint32_t H_, uint32_t K_)
      : H(H_), K(K_), nblocks((K_ + 1) / 2), nwords(bitmap_words<uint64_t>(H_)),
        te((nblocks + 63) / 64 * 64), to((nblocks + 63) / 64 * 64), bits(nwords), kept(nwords * 64), chosen(K_),
        pre(nwords + 1), sorted(K_) {}
};

// ------------------------------------------------------------------ generic (portable)
inline void select_row_generic(const KeyWords& key, uint32_t row, RowScratch& s) {
  const uint32_t H = s.H, K = s.K;
  uint32_t* te = s.te.data();
  uint32_t* to = s.to.data();
#pragma omp simd
  for (uint32_t b = 0; b < s.nblocks; ++b) draw_pair(key, row, H, K, b, te[b], to[b]);
  uint64_t* bits = s.bits.data();
  std::memset(bits, 0, s.nwords * sizeof(uint64_t));
  for (uint32_t d = 0; d < K; ++d) floyd_insert(bits, (d & 1) ? to[d / 2] : te[d / 2], H - K + d);
  uint32_t k = 0;
  for (uint32_t w = 0; w < s.nwords; ++w) {
    for (uint64_t word = bits[w]; word; word &= word - 1) s.sorted[k++] = w * 64 + __builtin_ctzll(word);
  }
}

#ifdef MESHKERN_MASK_SIMD
// Floyd with the kept dim of every draw recorded, then the rank ordering. Shared by the
// vector variants (inlined into each, so its popcounts get the variant's POPCNT).
// Floyd on a byte map (a load, a select and a plain store per draw, where a bitmap costs
// shifts and a read-modify-write: measured 0.6 -> 0.4 ms for 4096 rows of K = 102), the
// kept dim of every draw recorded; then BITS_FROM_BYTES (per ISA) packs the byte map into
// 64-bit words, and the rank ordering.
#define MESHKERN_FLOYD_BYTES                                                             \
  uint8_t* kept = s.kept.data();                                                         \
  uint32_t* chosen = s.chosen.data();                                                    \
  std::memset(kept, 0, s.nwords * 64);                                                   \
  const uint32_t j0 = H - K;                                                             \
  for (uint32_t b = 0; b < K / 2; ++b) {                                                 \
    const uint32_t t0 = te[b], c0 = kept[t0] ? j0 + 2 * b : t0;                          \
    kept[c0] = 0x80;                                                                     \
    chosen[2 * b] = c0;                                                                  \
    const uint32_t t1 = to[b], c1 = kept[t1] ? j0 + 2 * b + 1 : t1;                      \
    kept[c1] = 0x80;                                                                     \
    chosen[2 * b + 1] = c1;                                                              \
  }                                                                                      \
  if (K & 1) {                                                                           \
    const uint32_t t = te[K / 2], c = kept[t] ? j0 + K - 1 : t;                          \
    kept[c] = 0x80;                                                                      \
    chosen[K - 1] = c;                                                                   \
  }                                                                                      \
  uint64_t* bits = s.bits.data();

#define MESHKERN_RANK                                                                    \
  uint32_t* pre = s.pre.data();                                                          \
  pre[0] = 0;                                                                            \
  for (uint32_t w = 0; w < s.nwords; ++w) pre[w + 1] = pre[w] + __builtin_popcountll(bits[w]); \
  uint32_t* sorted = s.sorted.data();                                                    \
  for (uint32_t d = 0; d < K; ++d) {                                                     \
    const uint32_t c = chosen[d], w = c >> 6;                                            \
    sorted[pre[w] + __builtin_popcountll(_bzhi_u64(bits[w], c & 63))] = c;               \
  }

#define MESHKERN_T512 __attribute__((target("avx512f,avx512bw,avx2,bmi,bmi2,popcnt"))) inline
// hi:lo of a * m per 32-bit lane: vpmuludq multiplies the even lanes (low halves of the
// 64-bit lanes), a second one the odd lanes shifted down; blends put the halves back.
MESHKERN_T512 void mulhilo512(__m512i m, __m512i a, __m512i& hi, __m512i& lo) {
  const __mmask16 odd = 0xAAAA;
  const __m512i pe = _mm512_mul_epu32(a, m);
  const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  hi = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(pe, 32), po);
  lo = _mm512_mask_blend_epi32(odd, pe, _mm512_slli_epi64(po, 32));
}

// floor((hi * 2^32 + lo) * n / 2^64) per lane (draw_below), 64-bit sums per half.
MESHKERN_T512 __m512i below512(__m512i hi, __m512i lo, __m512i n) {
  const __m512i se = _mm512_add_epi64(_mm512_mul_epu32(hi, n), _mm512_srli_epi64(_mm512_mul_epu32(lo, n), 32));
  const __m512i hio = _mm512_srli_epi64(hi, 32), loo = _mm512_srli_epi64(lo, 32), no = _mm512_srli_epi64(n, 32);
  const __m512i so = _mm512_add_epi64(_mm512_mul_epu32(hio, no), _mm512_srli_epi64(_mm512_mul_epu32(loo, no), 32));
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(se, 32), so);
}

// U independent 16-block vectors from block b0 (U <= 4): one vector's rounds are a serial
// chain of multiplies, several keep the multipliers busy.
template <int U>
MESHKERN_T512 void philox_pass512(const KeyWords& key, uint32_t row, uint32_t H, uint32_t K, uint32_t b0,
                                  uint32_t* te, uint32_t* to) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i c0[U], c1[U], c2[U], c3[U];
  for (int u = 0; u < U; ++u) {
    c0[u] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(b0 + 16 * u)), iota);
    c1[u] = _mm512_set1_epi32(static_cast<int>(row));
    c2[u] = _mm512_set1_epi32(static_cast<int>(key.step));
    c3[u] = _mm512_set1_epi32(static_cast<int>(key.tag));
  }
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < 10; ++round) {
    const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0)), vk1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m512i hi0, lo0, hi1, lo1;
      mulhilo512(m0, c0[u], hi0, lo0);
      mulhilo512(m1, c2[u], hi1, lo1);
      c0[u] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[u]), vk0);
      c2[u] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[u]), vk1);
      c1[u] = lo1;
      c3[u] = lo0;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  const __m512i jbase = _mm512_set1_epi32(static_cast<int>(H - K + 1));  // n = j + 1 of draw 0
  for (int u = 0; u < U; ++u) {
    const __m512i blk = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(b0 + 16 * u)), iota);
    const __m512i ne = _mm512_add_epi32(jbase, _mm512_add_epi32(blk, blk));  // j + 1 for d = 2 b
    _mm512_storeu_si512(te + b0 + 16 * u, below512(c0[u], c1[u], ne));
    _mm512_storeu_si512(to + b0 + 16 * u, below512(c2[u], c3[u], _mm512_add_epi32(ne, _mm512_set1_epi32(1))));
  }
}

MESHKERN_T512 void select_row_avx512(const KeyWords& key, uint32_t row, RowScratch& s) {
  const uint32_t H = s.H, K = s.K;
  uint32_t* te = s.te.data();
  uint32_t* to = s.to.data();
  for (uint32_t b0 = 0; b0 < s.nblocks; b0 += 64) {
    switch (std::min<uint32_t>(4, (s.nblocks - b0 + 15) / 16)) {
      case 1: philox_pass512<1>(key, row, H, K, b0, te, to); break;
      case 2: philox_pass512<2>(key, row, H, K, b0, te, to); break;
      case 3: philox_pass512<3>(key, row, H, K, b0, te, to); break;
      default: philox_pass512<4>(key, row, H, K, b0, te, to); break;
    }
  }
  MESHKERN_PROFILE_STOP(0)
  MESHKERN_FLOYD_BYTES
  MESHKERN_PROFILE_STOP(1)
  for (uint32_t w = 0; w < s.nwords; ++w) bits[w] = _cvtmask64_u64(_mm512_movepi8_mask(_mm512_loadu_si512(kept + 64 * w)));
  MESHKERN_PROFILE_STOP(2)
  MESHKERN_RANK
}

#define MESHKERN_T256 __attribute__((target("avx2,bmi,bmi2,popcnt"))) inline
MESHKERN_T256 void mulhilo256(__m256i m, __m256i a, __m256i& hi, __m256i& lo) {
  const __m256i pe = _mm256_mul_epu32(a, m);
  const __m256i po = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
  lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
}

MESHKERN_T256 __m256i below256(__m256i hi, __m256i lo, __m256i n) {
  const __m256i se = _mm256_add_epi64(_mm256_mul_epu32(hi, n), _mm256_srli_epi64(_mm256_mul_epu32(lo, n), 32));
  const __m256i hio = _mm256_srli_epi64(hi, 32), loo = _mm256_srli_epi64(lo, 32), no = _mm256_srli_epi64(n, 32);
  const __m256i so = _mm256_add_epi64(_mm256_mul_epu32(hio, no), _mm256_srli_epi64(_mm256_mul_epu32(loo, no), 32));
  return _mm256_blend_epi32(_mm256_srli_epi64(se, 32), so, 0xAA);
}

template <int U>
MESHKERN_T256 void philox_pass256(const KeyWords& key, uint32_t row, uint32_t H, uint32_t K, uint32_t b0,
                                  uint32_t* te, uint32_t* to) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i c0[U], c1[U], c2[U], c3[U];
  for (int u = 0; u < U; ++u) {
    c0[u] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(b0 + 8 * u)), iota);
    c1[u] = _mm256_set1_epi32(static_cast<int>(row));
    c2[u] = _mm256_set1_epi32(static_cast<int>(key.step));
    c3[u] = _mm256_set1_epi32(static_cast<int>(key.tag));
  }
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < 10; ++round) {
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int>(k0)), vk1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo256(m0, c0[u], hi0, lo0);
      mulhilo256(m1, c2[u], hi1, lo1);
      c0[u] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[u]), vk0);
      c2[u] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[u]), vk1);
      c1[u] = lo1;
      c3[u] = lo0;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  const __m256i jbase = _mm256_set1_epi32(static_cast<int>(H - K + 1));
  for (int u = 0; u < U; ++u) {
    const __m256i blk = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(b0 + 8 * u)), iota);
    const __m256i ne = _mm256_add_epi32(jbase, _mm256_add_epi32(blk, blk));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(te + b0 + 8 * u), below256(c0[u], c1[u], ne));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + b0 + 8 * u),
                        below256(c2[u], c3[u], _mm256_add_epi32(ne, _mm256_set1_epi32(1))));
  }
}

MESHKERN_T256 void select_row_avx2(const KeyWords& key, uint32_t row, RowScratch& s) {
  const uint32_t H = s.H, K = s.K;
  uint32_t* te = s.te.data();
  uint32_t* to = s.to.data();
  for (uint32_t b0 = 0; b0 < s.nblocks; b0 += 32) {
    switch (std::min<uint32_t>(4, (s.nblocks - b0 + 7) / 8)) {
      case 1: philox_pass256<1>(key, row, H, K, b0, te, to); break;
      case 2: philox_pass256<2>(key, row, H, K, b0, te, to); break;
      case 3: philox_pass256<3>(key, row, H, K, b0, te, to); break;
      default: philox_pass256<4>(key, row, H, K, b0, te, to); break;
    }
  }
  MESHKERN_PROFILE_STOP(0)
  MESHKERN_FLOYD_BYTES
  MESHKERN_PROFILE_STOP(1)
  for (uint32_t w = 0; w < s.nwords; ++w) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kept + 64 * w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kept + 64 * w + 32));
    bits[w] = uint64_t(uint32_t(_mm256_movemask_epi8(lo))) | (uint64_t(uint32_t(_mm256_movemask_epi8(hi))) << 32);
  }
  MESHKERN_PROFILE_STOP(2)
  MESHKERN_RANK
}
#undef MESHKERN_FLOYD_BYTES
#undef MESHKERN_RANK
#undef MESHKERN_T512
#undef MESHKERN_T256
#endif  // MESHKERN_MASK_SIMD

using SelectRowFn = void (*)(const KeyWords&, uint32_t, RowScratch&);

// The fastest variant this CPU has, capped by MESHKERN_MASK_ISA=generic|avx2|avx512 (read
// at each op call, so tests can compare the variants against each other and the reference
// in one process). Every variant returns the same dims.
inline int best_isa() {  // 0 generic, 1 avx2, 2 avx512
#ifdef MESHKERN_MASK_SIMD
  static const int isa = !(__builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi2")) ? 0
                         : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 2
                         : __builtin_cpu_supports("avx2")    ? 1
                                                             : 0;
  return isa;
#else
  return 0;
#endif
}

inline int active_isa() {
  const char* cap = std::getenv("MESHKERN_MASK_ISA");
  int lim = 2;
  if (cap && std::strcmp(cap, "generic") == 0) lim = 0;
  if (cap && std::strcmp(cap, "avx2") == 0) lim = 1;
  const int isa = best_isa();
  return isa < lim ? isa : lim;
}

inline const char* isa_name(int isa) { return isa == 2 ? "avx512" : isa == 1 ? "avx2" : "generic"; }

inline SelectRowFn select_row_fn(int isa) {
#ifdef MESHKERN_MASK_SIMD
  if (isa == 2) return &select_row_avx512;
  if (isa == 1) return &select_row_avx2;
#endif
  (void)isa;
  return &select_row_generic;
}

}  // namespace mask
}  // namespace meshkern
