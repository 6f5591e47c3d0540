// Where the CPU mask selection spends its time, by phase and variant (csrc/mask/select_cpu.h).
// Not part of the build; compile and run by hand, 1 core:
//
//   g++ -O3 -fopenmp -std=c++17 -DMESHKERN_SELECT_PROFILE -Icsrc/common -Icsrc/mask \
//       bench/mask_select_profile.cpp -o /tmp/mask_select_profile && OMP_NUM_THREADS=1 /tmp/mask_select_profile
//
// Prints, for T=4096 rows (the bench's shape) and each (H, K): the time of the whole
// selection of every variant this CPU has, the vector variants stopped after each phase
// (Philox, + Floyd, + packing the byte map, + ranks = all), the old generic path's phases
// (Philox, + Floyd, + bitmap scan), with and without the fused gather of an fp32 [T, H]
// input (pack) and a next-row prefetch, and a read of every cache line of that input.
// Minimum of 7 runs (CPU time), and whether every variant returned the generic's dims.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <vector>

#include "select_cpu.h"

using namespace meshkern::mask;

static double cpu() { return double(std::clock()) / CLOCKS_PER_SEC; }

template <class F>
static double best_of(F f, int reps = 7) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = cpu();
    f();
    best = std::min(best, cpu() - t0);
  }
  return best * 1e3;
}

int main() {
  const uint32_t N = 4096;
  const KeyWords key{0x5EED, 0, 100, (1u << 16) | 3};
  const std::pair<uint32_t, uint32_t> cases[] = {{2048, 102}, {4096, 205}, {16384, 819}};
  for (auto [H, K] : cases) {
    std::printf("T=%u H=%u K=%u (ms)\n", N, H, K);
    std::vector<uint32_t> ref(size_t(N) * K);
    for (int isa = 0; isa <= best_isa(); ++isa) {
      RowScratch s(H, K);
      const SelectRowFn fn = select_row_fn(isa);
      std::vector<uint32_t> out(size_t(N) * K);
      const double t = best_of([&] {
        for (uint32_t r = 0; r < N; ++r) {
          fn(key, r, s);
          std::copy(s.sorted.begin(), s.sorted.end(), out.begin() + size_t(r) * K);
        }
      });
      if (isa == 0) ref = out;
      std::printf("  %-8s whole selection %7.3f%s\n", isa_name(isa), t, out == ref ? "" : "  MISMATCH");
      if (isa > 0) {
        const char* names[] = {"Philox", "+ Floyd", "+ packing", };
        for (int stop = 0; stop < 3; ++stop) {
          profile_stop = stop;
          std::printf("      stopped after %-10s %7.3f\n", names[stop],
                      best_of([&] { for (uint32_t r = 0; r < N; ++r) fn(key, r, s); }));
        }
        profile_stop = -1;
      }
    }
    // the old generic path, by phase
    {
      RowScratch s(H, K);
      uint32_t* te = s.te.data();
      uint32_t* to = s.to.data();
      uint64_t* bits = s.bits.data();
      volatile uint64_t sink = 0;
      auto phases = [&](int upto) {
        for (uint32_t r = 0; r < N; ++r) {
#pragma omp simd
          for (uint32_t b = 0; b < s.nblocks; ++b) draw_pair(key, r, H, K, b, te[b], to[b]);
          if (upto == 0) { sink = sink + te[0]; continue; }
          std::memset(bits, 0, s.nwords * 8);
          for (uint32_t d = 0; d < K; ++d) floyd_insert(bits, (d & 1) ? to[d / 2] : te[d / 2], H - K + d);
          if (upto == 1) { sink = sink + bits[0]; continue; }
          uint32_t k = 0;
          for (uint32_t w = 0; w < s.nwords; ++w)
            for (uint64_t word = bits[w]; word; word &= word - 1) s.sorted[k++] = w * 64 + __builtin_ctzll(word);
        }
      };
      std::printf("  old generic: Philox %7.3f  + Floyd %7.3f  + scan %7.3f\n", best_of([&] { phases(0); }),
                  best_of([&] { phases(1); }), best_of([&] { phases(2); }));
    }
    // the fused gather (pack, fp32) with and without prefetching the next row
    {
      std::vector<float> h(size_t(N) * H, 1.0f), packed(size_t(N) * K);
      std::vector<char> junk(size_t(64) << 20);
      const SelectRowFn fn = select_row_fn(best_isa());
      for (int pf = 0; pf < 2; ++pf) {
        RowScratch s(H, K);
        double best = 1e30;
        for (int r = 0; r < 7; ++r) {
          for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;  // evict h
          const double t0 = cpu();
          for (uint32_t row = 0; row < N; ++row) {
            if (pf && row + 1 < N)
              for (uint32_t c = 0; c < H; c += 16) __builtin_prefetch(&h[size_t(row + 1) * H + c], 0, 3);
            fn(key, row, s);
            for (uint32_t k = 0; k < K; ++k) packed[size_t(row) * K + k] = h[size_t(row) * H + s.sorted[k]];
          }
          best = std::min(best, cpu() - t0);
        }
        std::printf("  pack fp32 (%s): %7.3f\n", pf ? "next row prefetched" : "no prefetch", best * 1e3);
      }
      double best = 1e30;
      volatile float sink = 0;
      for (int r = 0; r < 7; ++r) {
        for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
        const double t0 = cpu();
        float acc = 0;
        for (size_t i = 0; i < h.size(); i += 16) acc += h[i];
        sink = acc;
        best = std::min(best, cpu() - t0);
      }
      std::printf("  read every cache line of the fp32 input: %7.3f\n", best * 1e3);
    }
  }
  return 0;
}
