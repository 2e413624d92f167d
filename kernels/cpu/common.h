// The pieces every op shares: bf16 <-> float, the row grain of elementwise ops,
// parallel_blocks (guided blocks from an atomic counter), a panel kernel's sink and
// its next panel's prefetch, and parallel_team (the team a parallel_for ran on).
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

using bf16 = c10::BFloat16;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) {
  return static_cast<T>(x);  // bf16: round to nearest even, as torch's .to(bfloat16)
}

// Rows of an op of `width` features that make one parallel task: torch's own
// elementwise ops stay on one thread below 32768 elements (its GRAIN_SIZE).
constexpr int64_t kGrain = 32768;
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
}

// Weight-streaming ops (the linears) hand out blocks of units from an atomic counter
// instead of at::parallel_for's static halves. Served, the team shares two cores with
// Serve's and Ray's threads: a worker preempted for a few hundred microseconds held
// half the op under static halves, and the other spun at the barrier for as long;
// with blocks it takes the remaining ones. Blocks shrink as the op goes ("guided"
// scheduling: a claim takes the remaining units / (2 x threads), at least `grain`),
// so an op has few boundaries, and small blocks at the end, where the balancing
// happens. A block is contiguous.
// f(begin, end, ahead): ahead() claims the thread's next block, once, and returns its
// first unit (n: there is none), so that a block's last unit can prefetch the next
// block's first one: without it each block began on weights not yet asked for, and
// bf16 panels of 8-64 rows ran 1.02-1.15x slower (BENCHMARKS.md, twenty-eighth round).
// f calls it at its last unit only, so a thread holds a block it has not begun for
// one unit's time at most. A block f did not ask ahead for is claimed after it.
template <class F>
void parallel_blocks(int64_t n, int64_t grain, const F& f) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const int64_t team = std::clamp<int64_t>((n + grain - 1) / grain, 1, threads);
  std::atomic<int64_t> next{0};
  // [b, e): the next block; false when none is left
  const auto claim = [&](int64_t& b, int64_t& e) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t size = std::max<int64_t>(grain, (n - begin) / (2 * threads));
      const int64_t end = std::min(n, begin + size);
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        b = begin, e = end;
        return true;
      }
    }
    return false;
  };
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    int64_t b = 0, e = 0;
    bool more = claim(b, e);
    while (more) {
      int64_t nb = n, ne = n;
      bool asked = false;
      const auto ahead = [&]() -> int64_t {
        if (!asked) asked = true, more = claim(nb, ne);
        return more ? nb : n;
      };
      f(b, e, ahead);
      if (!asked) more = claim(nb, ne);
      b = nb, e = ne;
    }
  });
}

// A panel kernel's outputs straight into y [M, N] (a linear layer).
template <typename Y>
struct IntoY {
  Y* y;
  int64_t N;
  Y* at(int64_t n0) const { return y + n0; }
  int64_t stride() const { return N; }
  void done(int64_t, int) const {}
};

// The next panel asked for into L2 while a panel kernel computes this one, a share of
// its `lines` cache lines in each of the panel's `tiles` tiles, so that the stream
// overlaps all of the panel's arithmetic: asked for by the last tile only, a 16-row
// bf16 panel cost its first tile's arithmetic plus the whole stream, and 13-20 rows
// ran 1.1-1.45x slower from memory; float32 panels with the hardware's stream prefetch
// alone ran 1.1-1.5x slower at 8-64 rows (BENCHMARKS.md, thirty-ninth round). A
// single tile of fewer than 8 rows asks for nothing: it is bound by its own stream,
// and a second one only competes with it (0.86-0.93x at 1-4 rows; sixteenth round).
// Into L2 (T1): at decode's 16-64 rows the LM head ran 1.1-1.4x faster than with T0,
// neutral from 96 rows up (nineteenth round). Within a tile the share is spread
// evenly over its inner steps, at most 2 lines a step (prefetch_step).
struct PanelPrefetch {
  const char* p;  // this tile's first line of the next panel
  int64_t lines;  // how many it asks for (0: none)
  // tile t of `tiles` over a panel of M rows; next: the next panel (nullptr: none)
  static PanelPrefetch share(const void* next, int64_t lines, int64_t M, int64_t t,
                             int64_t tiles) {
    if (next == nullptr || (tiles == 1 && M < 8)) lines = 0;
    const int64_t l0 = lines * t / tiles;
    return {static_cast<const char*>(next) + l0 * 64, lines * (t + 1) / tiles - l0};
  }
};

// once per inner step of a tile of `steps` steps: acc counts the share's lines
// asked for, in units of 1 / steps
inline void prefetch_step(const char*& p, int64_t& acc, int64_t lines, int64_t steps) {
  if (lines > 0) {
    acc += lines;
    while (acc >= steps) {
      __builtin_prefetch(p, 0, 2);  // prefetcht1
      p += 64, acc -= steps;
    }
  }
}


int64_t parallel_team(int64_t n) {
  std::vector<std::atomic<int>> seen(std::max<int64_t>(at::get_num_threads(), 1));
  for (auto& x : seen) x = 0;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && tid < (int)seen.size()) seen[tid] = 1;
  });
  int64_t used = 0;
  for (auto& x : seen) used += x.load();
  return used;
}

}  // namespace
