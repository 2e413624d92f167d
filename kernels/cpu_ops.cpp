// Native CPU ops of the torch serving path, run in torch's own thread pool.
//
// Built on first use by kernels/native.py (torch.utils.cpp_extension.load, ninja,
// -O3 -march=native -ffast-math -fopenmp) and registered as torch.ops.spur_cpu.*. No pybind:
// the ops are TORCH_LIBRARY schemas, so they dispatch like any aten op and the build
// stays small. Every op has a torch reference it is tested against (tests/kernels/
// test_native.py) and a Python caller that checks shapes, dtypes and strides first;
// the checks here (TORCH_CHECK) are the last line for index ranges C cannot guard.
//
// Parallel work goes through at::parallel_for, i.e. torch's OpenMP team: the second
// core works instead of spinning (the ctypes kernel this replaces ran on the calling
// thread while torch's idle workers spun on the other core). ATen's OpenMP backend is
// a `#pragma omp parallel` in its headers, so without -fopenmp at::parallel_for
// silently runs on the calling thread alone; GOMP_* resolve at load time to the
// libgomp torch already loaded (one OpenMP runtime, one team). `parallel_team(n)`
// says how many threads a parallel_for over n items ran on (tested).
//
// Ops (dtypes: float32 or bfloat16 activations; caches float32 or bfloat16):
//   decode_attention(q, out, k_cache, v_cache, tables, rows, firsts, lens, scale, lanes=0)
//       q, out [T, Hq, D] (stride(-1) == 1, stride(1) == D); k/v_cache [blocks,
//       block_size, Hkv, D] views; tables [N, W] int32; rows, firsts, lens [N]
//       int32. Decode i: query row rows[i] attends to positions [firsts[i], lens[i])
//       of its context through table row i; writes out[rows[i]] only. lanes: the
//       path, one of decode_lanes() (0: the widest; tests and benches pick others);
//       16 with bf16 q and cache is attend_bf16 on AVX-512 BF16 builds.
//   fused_add_rms_norm(x, residual, weight, eps) -> (norm(x + residual), x + residual)
//   rms_norm(x, weight, eps) -> norm(x)
//   silu_and_mul(x [n, 2d]) -> silu(x[:, :d]) * x[:, d:]            [n, d]
//   argmax_rows(x [m, V]) -> [m] int64: argmax(dim=-1) of float32 rows (NaN counts largest)
//   rope_store_kv(qkv, positions, cos_sin, kv_cache, slots, Hq, Hkv, D, rd) -> q
//       RoPE ("rotate half") of q and k at positions, k and v written into
//       kv_cache[0 / 1] at slots (-1: skip); returns the rotated q [n, Hq, D].
//   small_linear(x [M, K], weight [N, K], bias [N]?) -> x W^T + bias  [M, N]
//       bfloat16 only, M 1 to 64, K a multiple of 32, AVX-512 BF16 builds only
//       (small_linear_supported() says); float32 accumulation, one rounding.
//   linear_f32(x [M, K], weight [N, K], bias [N]?) -> x W^T + bias  [M, N]   float32
//   linear_f32_panels(x [M, K], panels [ceil(n / PW), K, PW], bias [n]?, n) -> [M, n]
//       the same over the weight packed once at load (native.pack_linear_f32);
//       linear_f32_panel_width() says PW (32 on AVX-512 builds, 16 on AVX2).
//   linear_bf16_panels(x [M, K], panels [ceil(n / 32), K / 2, 32, 2], bias [n]?, n)
//       -> [M, n] bfloat16, any M, K even, AVX-512 BF16 builds: the bf16 weight
//       packed once at load in pairs (native.pack_linear_bf16); one rounding. With
//       float_out=True: [M, n] float32 holding the same bf16-rounded values.
//   gate_up_silu(x [M, K], panels, bias [n]?, n) -> silu_and_mul(linear_*_panels(x,
//       panels, bias, n)) [M, n / 2] in one pass, bit for bit; n a multiple of twice
//       the panels' width (gate_up_silu_fits).
//   panel_rows(panels, ids [n] int64) -> [n, K]: rows `ids` of a weight packed into
//       bf16 or float32 panels (a tied embedding's lookup), bit for bit.
//   decoder_stack(hidden, positions, cos_sin, kv_caches, slots, norms, panels, ...)
//       every layer of a Llama decoder on the ops above, in one call (see there).
// Each rounds where its torch reference rounds (bf16: after every op), so bf16
// results equal the reference up to float32 summation order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SPUR_SIMD 1
#endif
#if defined(__AVX512F__)
#define SPUR_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SPUR_AVX2 1
#endif

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

// ----------------------------------------------------------------- decode attention
//
// One task = one (decode, KV head) pair: its G = Hq / Hkv query heads against the
// window's K rows (scores, float32), softmax, weighted sum of V rows. Positions are
// the outer loop so each K (then V) row is read once, in address order. Tasks are
// handed out longest window first from an atomic counter: contexts of a step vary
// from tens to thousands of positions, and static halves would leave a core idle.
// Ask for the next block's rows of this head while the current one is computed: the
// blocks of a context sit at scattered addresses, which the hardware prefetchers do
// not follow, and a task would otherwise wait on every block's first rows.
// Prefetches of K/V lines go to L2 (locality 2: prefetcht1), not L1 (prefetcht0):
// a context's lines are used once, and asked into L1 they evict the scores and sums
// the arithmetic works on; into L2 the kernel read 1.25-1.3x (float32 cache) and 1.5-1.8x
// (bf16, LineFeed below) as many bytes a second from memory (BENCHMARKS.md, nineteenth round).
constexpr int kKvPrefetchLocality = 2;
template <typename KV>
inline void prefetch_rows(const KV* base, int64_t s_off, int32_t rows, int32_t D) {
  const int64_t row_bytes = (int64_t)D * sizeof(KV);
  for (int32_t j = 0; j < rows; ++j) {
    const char* r = reinterpret_cast<const char*>(base + (int64_t)j * s_off);
    for (int64_t off = 0; off < row_bytes; off += 64)
      __builtin_prefetch(r + off, 0, kKvPrefetchLocality);
  }
}

// Calls run(first row, n, t) for the runs of n <= max_run consecutive rows of one
// block that cover positions first + t, t in [0, width), of one head's K or V cache
// through the block table. Block by block: a block's rows are s_off apart, so no
// division per position; the next block is prefetched (`span` elements of each row)
// before this one is used (AHEAD 0: none; the caller prefetches, as attend_bf16 does).
template <int AHEAD = 1, typename KV, typename Run>
inline void for_each_block_run(const KV* base, int64_t s_blk, int64_t s_off,
                               const int32_t* table, int32_t first, int32_t width, int32_t bs,
                               int32_t span, int32_t max_run, Run&& run) {
  const int32_t end = first + width, b0 = first / bs, blocks = (end + bs - 1) / bs;
  for (int32_t b = b0, t = 0; t < width; ++b) {
    const KV* blk = base + (int64_t)table[b] * s_blk;
    static_assert(AHEAD == 0 || AHEAD == 1, "one block ahead, or none");
    if (AHEAD == 1 && b + 1 < blocks)
      prefetch_rows(base + (int64_t)table[b + 1] * s_blk, s_off, bs, span);
    int32_t lo = (b == b0) ? first % bs : 0;
    const int32_t hi = std::min<int32_t>(bs, end - b * bs);
    while (lo < hi) {
      const int32_t n = std::min<int32_t>(max_run, hi - lo);
      run(blk + (int64_t)lo * s_off, n, t);
      lo += n;
      t += n;
    }
  }
}

// Calls row(pointer to the row, t) for each position first + t, t in [0, width).
template <typename KV, typename Row>
inline void for_each_row(const KV* base, int64_t s_blk, int64_t s_off, const int32_t* table,
                         int32_t first, int32_t width, int32_t bs, int32_t D, Row&& row) {
  for_each_block_run(base, s_blk, s_off, table, first, width, bs, D, bs,
                     [&](const KV* r0, int32_t n, int32_t t) {
                       for (int32_t j = 0; j < n; ++j) row(r0 + (int64_t)j * s_off, t + j);
                     });
}

// Softmax of each of the G score rows [G, width] in place (float32).
inline void softmax_rows(float* __restrict scores, int32_t G, int32_t width) {
  for (int32_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + (int64_t)g * width;
    float m = -FLT_MAX;  // -ffast-math: no infinities
    for (int32_t t = 0; t < width; ++t) m = sg[t] > m ? sg[t] : m;
    float total = 0.0f;
    for (int32_t t = 0; t < width; ++t) {
      sg[t] = std::exp(sg[t] - m);
      total += sg[t];
    }
    const float inv = 1.0f / total;
    for (int32_t t = 0; t < width; ++t) sg[t] *= inv;
  }
}

template <typename KV, typename QO, int DC, int GC>
void attend(const QO* __restrict q, QO* __restrict o, const KV* __restrict k,
            const KV* __restrict v, int64_t s_blk, int64_t s_off, const int32_t* table,
            int32_t first, int32_t width, int32_t bs, int32_t Grt, int32_t Drt, float scale,
            float* __restrict qf, float* __restrict scores, float* __restrict acc) {
  const int32_t D = DC > 0 ? DC : Drt;
  const int32_t G = GC > 0 ? GC : Grt;
  for (int64_t x = 0; x < (int64_t)G * D; ++x) qf[x] = to_f(q[x]) * scale;
  for_each_row(k, s_blk, s_off, table, first, width, bs, D,
               [&](const KV* __restrict kr, int32_t t) {
    for (int32_t g = 0; g < G; ++g) {
      const float* __restrict qg = qf + (int64_t)g * D;
      float s = 0.0f;
      for (int32_t d = 0; d < D; ++d) s += qg[d] * to_f(kr[d]);
      scores[(int64_t)g * width + t] = s;
    }
  });
  softmax_rows(scores, G, width);
  for (int64_t x = 0; x < (int64_t)G * D; ++x) acc[x] = 0.0f;
  for_each_row(v, s_blk, s_off, table, first, width, bs, D,
               [&](const KV* __restrict vr, int32_t t) {
    for (int32_t g = 0; g < G; ++g) {
      const float w = scores[(int64_t)g * width + t];
      float* __restrict ag = acc + (int64_t)g * D;
      for (int32_t d = 0; d < D; ++d) ag[d] += w * to_f(vr[d]);
    }
  });
  for (int64_t x = 0; x < (int64_t)G * D; ++x) o[x] = from_f<QO>(acc[x]);
}

#ifdef SPUR_SIMD
// The SIMD path for head_dim 64 and 128, on AVX-512 (16 float lanes) or AVX2 + FMA
// (8 lanes). The loop above spends most of its time in a horizontal sum per position
// and query head (the dot product's lanes to one score) and in reloading and storing
// its float accumulators per row: here a run of up to W rows of a block (W = the
// vector's lanes) is one unit. K: each row's dot product stays a vector of W lane
// sums, and V::sums turns the run's W vectors into their W scores with one
// transpose-and-add (not W separate reductions); V: the accumulators of one query
// head stay in registers over the run. bf16 rows are widened to float once per run
// into an L1 scratch (not once per query head). Both passes walk D in chunks of 8
// vectors, so the q chunk and the W row sums (K), or the accumulators (V), fit the
// register file (AVX2: 16 ymm registers). Same math, float32 throughout; only the
// order of the additions differs from the loop above.
#ifdef SPUR_AVX512
// 16 bf16 as 16 floats (bf16 is float's upper half).
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

struct Vec512 {
  using T = __m512;
  static constexpr int W = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_first(float* p, T v, int32_t n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v);
  }
  // the first n < W floats at p, the other lanes 0 (nothing past p + n is read)
  static T load_first(const float* p, int32_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  }
  // W bf16 values at src widened to float at dst (bf16 is float's upper half).
  static void widen(const bf16* src, float* dst) {
    _mm512_storeu_ps(dst, widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
  }
  // r[j] = the sum of a[j]'s 16 lanes, j < 16: a transpose-and-add in four levels. Each
  // pair of vectors is added as a blend (the halves that stay in place) plus one shuffle
  // (the others): 16 shuffles in all, where two shuffles a pair took 31. Every level
  // adds the same pairs as the two-shuffle form, so the sums are the same bits.
  static T sums(const T* a) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)  // c[i]: 128-bit lanes 0-1 hold a[2i]'s partials, 2-3 a[2i+1]'s
      c[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a[2 * i], a[2 * i + 1]),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x4E));
    // d[i]: lane k holds 4 partials of a[4i + {0, 2, 1, 3}[k]]
    const __m512i cross = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    for (int i = 0; i < 4; ++i)
      d[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, c[2 * i], c[2 * i + 1]),
                           _mm512_permutex2var_ps(c[2 * i], cross, c[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // e[i]: in lane k, 2 of d[2i]'s lane k, then 2 of d[2i + 1]'s
      e[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, d[2 * i], d[2 * i + 1]),
                           _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x4E));
    // f[4k + j] = sum(a[{0, 8, 4, 12}[j] + {0, 2, 1, 3}[k]]); put them in order
    const __m512 f = _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, e[0], e[1]),
                                   _mm512_permute_ps(_mm512_mask_blend_ps(0xAAAA, e[1], e[0]), 0xB1));
    const __m512i order =
        _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
    return _mm512_permutexvar_ps(order, f);
  }
};
#endif

#ifdef SPUR_AVX2
struct Vec256 {
  using T = __m256;
  static constexpr int W = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_first(float* p, T v, int32_t n) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int32_t j = 0; j < n; ++j) p[j] = tmp[j];
  }
  static T load_first(const float* p, int32_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static void widen(const bf16* src, float* dst) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  // r[j] = the sum of a[j]'s 8 lanes, j < 8: two levels of pairwise adds within
  // 128-bit halves, then the halves added.
  static T sums(const T* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    // u0 = [a0 a1 a2 a3 (lanes 0-3) | a0 a1 a2 a3 (lanes 4-7)], u1 the same for a4-a7
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#endif

// Calls run(rows, stride, h, n, t) for runs of n <= V::W consecutive rows of one
// block (positions first + t .. first + t + n - 1) and, within each run, for each of
// the H KV heads h: its rows as float, in place for a float cache, widened into
// `scratch` ([V::W, D]) for bf16. A run's heads are one contiguous span of each row
// (the cache is [blocks, block_size, heads, D]): a block is read once, front to back,
// with the next block prefetched whole.
template <class V, typename KV, typename Run>
inline void for_each_run(const KV* base, int64_t s_blk, int64_t s_off, int64_t s_head,
                         int32_t H, const int32_t* table, int32_t first, int32_t width,
                         int32_t bs, int32_t D, float* __restrict scratch, Run&& run) {
  const int32_t span = (int32_t)((H - 1) * s_head + D);  // elements of a row's H heads
  for_each_block_run(base, s_blk, s_off, table, first, width, bs, span, V::W,
                     [&](const KV* r0, int32_t n, int32_t t) {
    for (int32_t h = 0; h < H; ++h) {
      const KV* rh = r0 + (int64_t)h * s_head;
      if constexpr (std::is_same_v<KV, float>) {
        run(rh, s_off, h, n, t);
      } else {
        for (int32_t j = 0; j < n; ++j)
          for (int32_t d = 0; d < D; d += V::W)
            V::widen(rh + (int64_t)j * s_off + d, scratch + (int64_t)j * D + d);
        run(static_cast<const float*>(scratch), (int64_t)D, h, n, t);
      }
    }
  });
}

// One decode, all H KV heads (query heads h * G .. h * G + G - 1 read KV head h): q
// and o [H * G, D]; k and v point at head 0's cache, heads s_head apart.
template <class V, typename KV, typename QO, int D>
void attend_simd(const QO* __restrict q, QO* __restrict o, const KV* __restrict k,
                 const KV* __restrict v, int64_t s_blk, int64_t s_off, int64_t s_head,
                 const int32_t* table, int32_t first, int32_t width, int32_t bs, int32_t H,
                 int32_t G, float scale, float* __restrict qf, float* __restrict scores,
                 float* __restrict acc, float* __restrict scratch) {
  using T = typename V::T;
  constexpr int W = V::W, C = D / W, K = C < 8 ? C : 8;  // K: vectors per chunk
  const int32_t Hq = H * G;
  for (int64_t x = 0; x < (int64_t)Hq * D; ++x) qf[x] = to_f(q[x]) * scale;
  for_each_run<V>(k, s_blk, s_off, s_head, H, table, first, width, bs, D, scratch,
                  [&](const float* __restrict r0, int64_t stride, int32_t h, int32_t n,
                      int32_t t) {
    for (int32_t g = h * G; g < h * G + G; ++g) {
      T a[W];
      for (int c0 = 0; c0 < C; c0 += K) {
        T qv[K];
        for (int c = 0; c < K; ++c) qv[c] = V::load(qf + (int64_t)g * D + W * (c0 + c));
        for (int32_t j = 0; j < W; ++j) {
          if (j < n) {
            const float* r = r0 + (int64_t)j * stride + W * c0;
            T s = c0 == 0 ? V::mul(qv[0], V::load(r)) : V::fmadd(qv[0], V::load(r), a[j]);
            for (int c = 1; c < K; ++c) s = V::fmadd(qv[c], V::load(r + W * c), s);
            a[j] = s;
          } else {
            a[j] = V::zero();
          }
        }
      }
      V::store_first(scores + (int64_t)g * width + t, V::sums(a), n);
    }
  });
  softmax_rows(scores, Hq, width);
  for (int64_t x = 0; x < (int64_t)Hq * D; ++x) acc[x] = 0.0f;
  for_each_run<V>(v, s_blk, s_off, s_head, H, table, first, width, bs, D, scratch,
                  [&](const float* __restrict r0, int64_t stride, int32_t h, int32_t n,
                      int32_t t) {
    for (int32_t g = h * G; g < h * G + G; ++g) {
      const float* w = scores + (int64_t)g * width + t;
      for (int c0 = 0; c0 < C; c0 += K) {
        float* ag = acc + (int64_t)g * D + W * c0;
        T av[K];
        for (int c = 0; c < K; ++c) av[c] = V::load(ag + W * c);
        for (int32_t j = 0; j < n; ++j) {
          const T wj = V::set1(w[j]);
          const float* r = r0 + (int64_t)j * stride + W * c0;
          for (int c = 0; c < K; ++c) av[c] = V::fmadd(wj, V::load(r + W * c), av[c]);
        }
        for (int c = 0; c < K; ++c) V::store(ag + W * c, av[c]);
      }
    }
  });
  for (int64_t x = 0; x < (int64_t)Hq * D; ++x) o[x] = from_f<QO>(acc[x]);
}
#endif

#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
// 16 bf16 at p as float; 16 floats rounded to bf16 (to nearest even, as torch's
// .to(bfloat16); vcvtneps2bf16 flushes denormals to zero).
inline __m512 load_bf16(const bf16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline void store_bf16(bf16* p, __m256i h) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
// e^x for 16 floats, within 2 ulp of float's exp (Cephes' expf: x = n ln 2 + r with
// |r| <= ln 2 / 2, a degree-7 polynomial for e^r, 2^n by vscalefps), for the bf16 paths,
// whose results are rounded to bf16 (8 bits) after it: libmvec's vector expf, which
// -ffast-math loops call, falls back to scalar code for any lane below -87. x is
// clamped to [-87.3, 88.3]: e^x stays a normal float, never inf (the caller handles
// where float's own exp overflows, past 88.72).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626f)), _mm512_set1_ps(-87.3365448f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// Floats of attend_bf16's scratch per query head (see there): decode_typed sizes its
// per-thread `scores` buffer to at least this many a head.
constexpr int64_t kBf16ScratchPerHead = 33;

#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
// The path of bf16 queries on a bf16 cache (head_dim 64 or 128, AVX-512 BF16 builds,
// lanes 16). K: the scores are dot products of pairs (vdpbf16ps) of the query's bf16
// values and the K rows as stored: exact products, float32 sums, scaled after the sum;
// no widening into a scratch and no float copy of q (attend_simd widens every K row
// to float first and reloads it per query head). A run of up to 16 rows' 16 lane
// vectors become their scores with one Vec512::sums. V: each row is widened in
// registers and added into the float32 sums of the query heads of its KV head (up to
// 16 vectors, loaded and stored once a run). One pass over the window: each run's K rows,
// then its V rows while they are in L1, with an online softmax (the sums kept relative
// to the largest score so far, rescaled when a run brings a larger one). Same math as
// `attend` (float32 softmax and sums), up to the order of the additions and e^x within 2
// ulp (exp16). 1.7x attend_simd with the cache in L3, 1.1-1.2x from memory
// (BENCHMARKS.md, sixteenth round); with the K pass feeding its prefetches (LineFeed)
// 1.3x more from memory (0.65 vs 0.85 ms a layer at 61 decodes, seventeenth); in one
// pass 1.15x more (0.66 vs 0.77 ms, twenty-sixth round): the two-pass kernel's V pass
// waited on rows it found in L2. With the cache in L2 / L3 the one pass is 0.9x the two
// (0.37 vs 0.33 ms): its softmax updates a run cost more than one softmax loop.
// The cache lines of one context's blocks, K rows then V rows block by block, issued
// as prefetches a few at a time by feed(n) between the computation. A block's ~200
// lines prefetched at once (prefetch_rows) stall the core: each waits for a free miss
// buffer, and the arithmetic queued behind them waits too, so a context's time was
// its memory time plus its arithmetic (BENCHMARKS.md, seventeenth round). Fed in
// small doses the arithmetic runs while the lines arrive. A segment is a contiguous
// byte range: all of a block's K (or V) rows when they are contiguous (the pool's
// [blocks, block_size, kv_heads, head_dim] layout), one row's `span` otherwise.
template <typename KV>
struct LineFeed {
  const char* k;
  const char* v;
  const int32_t* table;
  int64_t blk_bytes, row_stride, seg_bytes;
  int32_t segs, b, end;
  const char* cur = nullptr;
  const char* seg_end = nullptr;
  int32_t seg = 0, part = 0;  // part 0: the block's K rows, 1: its V rows
  LineFeed(const KV* k_, const KV* v_, const int32_t* table_, int64_t s_blk, int64_t s_off,
           int32_t span, int32_t bs, int32_t b0, int32_t blocks)
      : k(reinterpret_cast<const char*>(k_)), v(reinterpret_cast<const char*>(v_)),
        table(table_), blk_bytes(s_blk * (int64_t)sizeof(KV)),
        row_stride(s_off * (int64_t)sizeof(KV)), b(b0), end(blocks) {
    const bool contiguous = s_off == span;
    seg_bytes = (contiguous ? (int64_t)bs : 1) * span * (int64_t)sizeof(KV);
    segs = contiguous ? 1 : bs;
    if (b < end) start(k + table[b] * blk_bytes);
  }
  void start(const char* p) {
    cur = p;
    seg_end = p + seg_bytes;
  }
  // Lines of one block, K and V.
  int64_t block_lines() const { return 2 * segs * ((seg_bytes + 63) / 64); }
  // Prefetches the next n lines (fewer at the context's end).
  inline void feed(int64_t n) {
    for (; n > 0 && b < end; --n) {
      __builtin_prefetch(cur, 0, kKvPrefetchLocality);  // into L2: see prefetch_rows
      cur += 64;
      if (cur < seg_end) continue;
      if (++seg < segs) {
        start(seg_end - seg_bytes + row_stride);
        continue;
      }
      seg = 0;
      if (part == 0) {
        part = 1;
        start(v + table[b] * blk_bytes);
      } else {
        part = 0;
        if (++b < end) start(k + table[b] * blk_bytes);
      }
    }
  }
};

template <int D>
void attend_bf16(const bf16* __restrict q, bf16* __restrict o, const bf16* __restrict k,
                 const bf16* __restrict v, int64_t s_blk, int64_t s_off, int64_t s_head,
                 const int32_t* table, int32_t first, int32_t width, int32_t bs, int32_t H,
                 int32_t G, float scale, float* __restrict scratch, float* __restrict acc) {
  constexpr int C = D / 32;    // vectors of 32 bf16 per row (K)
  constexpr int CV = D / 16;   // vectors of 16 floats per row (V)
  constexpr int GB = 16 / CV;  // query heads whose V sums fit 16 registers
  const int32_t span = (int32_t)((H - 1) * s_head + D);  // elements of a row's H heads
  const int32_t Hq = H * G;
  // scratch (Hq * kBf16ScratchPerHead floats): a run's probabilities [Hq][16], the
  // running sums of the probabilities [Hq][16 lanes], the running maxima [Hq].
  float* __restrict p = scratch;
  float* __restrict lsum = scratch + (int64_t)Hq * 16;
  float* __restrict m = scratch + (int64_t)Hq * 32;
  for (int32_t g = 0; g < Hq; ++g) m[g] = -FLT_MAX;
  for (int64_t x = 0; x < (int64_t)Hq * 16; ++x) lsum[x] = 0.0f;
  for (int64_t x = 0; x < (int64_t)Hq * D; ++x) acc[x] = 0.0f;
  const __m512 sv = _mm512_set1_ps(scale);
  // One pass: each run's K rows, then its V rows while they are fresh. The lines stay
  // one block ahead in flight (K and V of the block after the run's), fed a dose at a
  // time over the run's H * G score rows.
  const int32_t b0 = first / bs, blocks = (first + width + bs - 1) / bs;
  LineFeed<bf16> lines(k, v, table, s_blk, s_off, span, bs, b0, blocks);
  lines.feed(lines.block_lines());
  for_each_block_run<0>(k, s_blk, s_off, table, first, width, bs, span, 16,
                        [&](const bf16* r0, int32_t n, int32_t) {
    const bf16* v0 = v + (r0 - k);  // the run's V rows: the same offsets in the V cache
    const int64_t dose = (lines.block_lines() * n / bs + H * G - 1) / (H * G);
    const __mmask16 valid = (__mmask16)((1u << n) - 1u);
    for (int32_t h = 0; h < H; ++h) {
      const bf16* rh = r0 + (int64_t)h * s_head;
      for (int32_t g = h * G; g < h * G + G; ++g) {
        lines.feed(dose);
        __m512bh qv[C];
        for (int c = 0; c < C; ++c)
          qv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + g * D + 32 * c));
        __m512 a[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          if (j < n) {
            const bf16* r = rh + (int64_t)j * s_off;
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < C; ++c)
              s = _mm512_dpbf16_ps(
                  s, qv[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(r + 32 * c)));
            a[j] = s;
          } else {
            a[j] = _mm512_setzero_ps();
          }
        }
        // Rows past the run's n score the lowest float: exp16 clamps them to e^-87.3,
        // under 1e-37, beside the run's largest (1): nothing.
        const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX),
                                              _mm512_mul_ps(Vec512::sums(a), sv));
        // Online softmax: sums are kept relative to the largest score so far, and
        // rescaled only when a run brings a larger one (rarely, after the first runs).
        const float top = _mm512_reduce_max_ps(s);
        if (top > m[g]) {
          const __m512 cf = _mm512_set1_ps(std::exp(m[g] - top));  // 0 on the first run
          m[g] = top;
          _mm512_storeu_ps(lsum + (int64_t)g * 16, _mm512_mul_ps(cf, _mm512_loadu_ps(lsum + (int64_t)g * 16)));
          for (int c = 0; c < CV; ++c)
            _mm512_storeu_ps(acc + (int64_t)g * D + 16 * c,
                             _mm512_mul_ps(cf, _mm512_loadu_ps(acc + (int64_t)g * D + 16 * c)));
        }
        const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[g])));
        _mm512_storeu_ps(lsum + (int64_t)g * 16, _mm512_add_ps(e, _mm512_loadu_ps(lsum + (int64_t)g * 16)));
        _mm512_storeu_ps(p + (int64_t)g * 16, e);
      }
      const bf16* vh = v0 + (int64_t)h * s_head;
      for (int32_t g0 = h * G; g0 < h * G + G; g0 += GB) {
        const int32_t ng = std::min<int32_t>(GB, h * G + G - g0);
        __m512 av[GB][CV];
#pragma GCC unroll 16
        for (int gi = 0; gi < GB; ++gi)
          for (int c = 0; c < CV; ++c)
            av[gi][c] = gi < ng ? _mm512_loadu_ps(acc + (int64_t)(g0 + gi) * D + 16 * c)
                                : _mm512_setzero_ps();
        for (int32_t j = 0; j < n; ++j) {
          const bf16* r = vh + (int64_t)j * s_off;
          __m512 vr[CV];
          for (int c = 0; c < CV; ++c) vr[c] = load_bf16(r + 16 * c);
#pragma GCC unroll 16
          for (int gi = 0; gi < GB; ++gi) {
            if (gi >= ng) break;
            const __m512 w = _mm512_set1_ps(p[(int64_t)(g0 + gi) * 16 + j]);
            for (int c = 0; c < CV; ++c) av[gi][c] = _mm512_fmadd_ps(w, vr[c], av[gi][c]);
          }
        }
#pragma GCC unroll 16
        for (int gi = 0; gi < GB; ++gi) {
          if (gi >= ng) break;
          for (int c = 0; c < CV; ++c)
            _mm512_storeu_ps(acc + (int64_t)(g0 + gi) * D + 16 * c, av[gi][c]);
        }
      }
    }
  });
  for (int32_t g = 0; g < Hq; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + (int64_t)g * 16)));
    for (int c = 0; c < CV; ++c)
      store_bf16(o + (int64_t)g * D + 16 * c,
                 to_bf16(_mm512_mul_ps(inv, _mm512_loadu_ps(acc + (int64_t)g * D + 16 * c))));
  }
}
#endif

template <typename KV, typename QO>
void decode_typed(const at::Tensor& q, const at::Tensor& out, const at::Tensor& kc,
                  const at::Tensor& vc, const at::Tensor& tables, const at::Tensor& rows,
                  const at::Tensor& firsts, const at::Tensor& lens, double scale,
                  int64_t lanes) {
  const int64_t N = rows.size(0);
  const int32_t Hq = q.size(1), D = q.size(2), Hkv = kc.size(2), bs = kc.size(1);
  const int32_t G = Hq / Hkv;
  const int64_t s_blk = kc.stride(0), s_off = kc.stride(1), s_head = kc.stride(2);
  const int64_t q_row = q.stride(0), o_row = out.stride(0), t_row = tables.stride(0);
  const QO* qp = q.data_ptr<QO>();
  QO* op = out.data_ptr<QO>();
  const KV* kp = kc.data_ptr<KV>();
  const KV* vp = vc.data_ptr<KV>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* rp = rows.data_ptr<int32_t>();
  const int32_t* fp = firsts.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  int64_t widest = 1;
  std::vector<int64_t> order(N);
  for (int64_t i = 0; i < N; ++i) {
    order[i] = i;
    widest = std::max<int64_t>(widest, lp[i] - fp[i]);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lp[a] - fp[a] > lp[b] - fp[b]; });
  // One task = one decode. The SIMD path reads each block once for all its KV heads
  // (a block's rows hold every head); the loop walks the context once per KV head,
  // the first head's pass bringing the blocks into L2 for the others where L2 holds
  // the context (2 MiB per core: yes; 512 KiB: not past ~250 float32 positions of 3
  // heads of 64, and then every head reads it from memory again).
  const int64_t tasks = N;
  std::atomic<int64_t> next{0};
  const int64_t team = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    // scores: [Hq, widest] for the other paths, attend_bf16's scratch
    std::vector<float> qf((size_t)Hq * D),
        scores((size_t)Hq * std::max<int64_t>(widest, kBf16ScratchPerHead)), acc((size_t)Hq * D);
    std::vector<float> scratch((size_t)16 * D);
    for (;;) {
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= tasks) break;
      const int64_t i = order[task];
      const int64_t row = rp[i];
      const int32_t* table = tp + i * t_row;
      const int32_t first = fp[i], width = lp[i] - fp[i];
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<KV, bf16> && std::is_same_v<QO, bf16>) {
        if ((D == 64 || D == 128) && lanes == 16) {
          const QO* qi = qp + row * q_row;
          QO* oi = op + row * o_row;
          if (D == 64)
            attend_bf16<64>(qi, oi, kp, vp, s_blk, s_off, s_head, table, first, width, bs,
                            Hkv, G, (float)scale, scores.data(), acc.data());
          else
            attend_bf16<128>(qi, oi, kp, vp, s_blk, s_off, s_head, table, first, width, bs,
                             Hkv, G, (float)scale, scores.data(), acc.data());
          continue;
        }
      }
#endif
#ifdef SPUR_SIMD
      if ((D == 64 || D == 128) && lanes > 1) {
        const auto simd = [&](auto vec) {
          using V = decltype(vec);
          const QO* qi = qp + row * q_row;
          QO* oi = op + row * o_row;
          if (D == 64)
            attend_simd<V, KV, QO, 64>(qi, oi, kp, vp, s_blk, s_off, s_head, table, first,
                                       width, bs, Hkv, G, (float)scale, qf.data(),
                                       scores.data(), acc.data(), scratch.data());
          else
            attend_simd<V, KV, QO, 128>(qi, oi, kp, vp, s_blk, s_off, s_head, table, first,
                                        width, bs, Hkv, G, (float)scale, qf.data(),
                                        scores.data(), acc.data(), scratch.data());
        };
#ifdef SPUR_AVX512
        if (lanes == 16) simd(Vec512{});
#endif
#ifdef SPUR_AVX2
        if (lanes == 8) simd(Vec256{});
#endif
        continue;
      }
#endif
      // Other head sizes, lanes 1, or a CPU without AVX2 + FMA: head geometry as
      // constants where models have it (SmolLM2: D 64, G 3; Llama 3 and Qwen: D 128,
      // G 4 to 8), so the head loops unroll and the q rows stay in registers.
      for (int32_t h = 0; h < Hkv; ++h) {
        const QO* qi = qp + row * q_row + (int64_t)h * G * D;
        QO* oi = op + row * o_row + (int64_t)h * G * D;
        const KV* ki = kp + h * s_head;
        const KV* vi = vp + h * s_head;
        const auto run = [&](auto dc, auto gc) {
          attend<KV, QO, decltype(dc)::value, decltype(gc)::value>(
              qi, oi, ki, vi, s_blk, s_off, table, first, width, bs, G, D, (float)scale,
              qf.data(), scores.data(), acc.data());
        };
        using D64 = std::integral_constant<int, 64>;
        using D128 = std::integral_constant<int, 128>;
        using Any = std::integral_constant<int, 0>;
        if (D == 64 && G == 3) run(D64{}, std::integral_constant<int, 3>{});
        else if (D == 64 && G == 4) run(D64{}, std::integral_constant<int, 4>{});
        else if (D == 64) run(D64{}, Any{});
        else if (D == 128 && G == 4) run(D128{}, std::integral_constant<int, 4>{});
        else if (D == 128 && G == 8) run(D128{}, std::integral_constant<int, 8>{});
        else if (D == 128) run(D128{}, Any{});
        else run(Any{}, Any{});
      }
    }
  });
}

// The decode paths this build has, widest first: 16 (AVX-512), 8 (AVX2 + FMA), 1 (the
// loop every CPU runs; head sizes other than 64 and 128 always take it).
std::vector<int64_t> decode_lanes() {
  std::vector<int64_t> lanes;
#ifdef SPUR_AVX512
  lanes.push_back(16);
#endif
#ifdef SPUR_AVX2
  lanes.push_back(8);
#endif
  lanes.push_back(1);
  return lanes;
}

// What decode_attention and prefill_attention need of q, out and the caches.
void check_attention_args(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                          const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q and out must be [tokens, heads, head_dim] of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "q and out rows must be contiguous [heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1 &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "K and V caches must be [blocks, block_size, kv_heads, head_dim] views of one "
              "layout, contiguous in head_dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head_dim or head counts of q and the cache disagree");
}

void decode_attention(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& tables,
                      const at::Tensor& rows, const at::Tensor& firsts, const at::Tensor& lens,
                      double scale, int64_t lanes) {
  check_attention_args(q, out, k_cache, v_cache);
  for (const auto* t : {&tables, &rows, &firsts, &lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors: int32");
  const auto avail = decode_lanes();
  if (lanes == 0) lanes = avail.front();
  TORCH_CHECK(std::find(avail.begin(), avail.end(), lanes) != avail.end(), "decode_attention: ",
              lanes, " lanes is not a path of this build: decode_lanes() lists those it has");
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  if (rows.size(0) == 0) return;
  if (kt == at::kFloat && qt == at::kFloat)
    decode_typed<float, float>(q, out, k_cache, v_cache, tables, rows, firsts, lens, scale,
                              lanes);
  else if (kt == at::kFloat && qt == at::kBFloat16)
    decode_typed<float, bf16>(q, out, k_cache, v_cache, tables, rows, firsts, lens, scale,
                              lanes);
  else if (kt == at::kBFloat16 && qt == at::kFloat)
    decode_typed<bf16, float>(q, out, k_cache, v_cache, tables, rows, firsts, lens, scale,
                              lanes);
  else if (kt == at::kBFloat16 && qt == at::kBFloat16)
    decode_typed<bf16, bf16>(q, out, k_cache, v_cache, tables, rows, firsts, lens, scale,
                              lanes);
  else
    TORCH_CHECK(false, "decode_attention: float32 / bfloat16 only, got ", qt, " and ", kt);
}

// ----------------------------------------------------------------- prefill attention
//
// Prefill chunks with bf16 q on a bf16 cache (head_dim 64 or 128, AVX-512 BF16 builds).
// One task = a tile of up to 16 consecutive query tokens of one chunk and one KV head,
// for each of the head's G query heads. The tile's query rows are transposed once into
// pairs, qt[D/2][16 tokens], so that one key's scores for the 16 tokens are one vector:
// vdpbf16ps of qt[p] with the key's pair p broadcast from the cache as stored (K is
// neither copied nor transposed, and there are no horizontal sums). The softmax runs
// lane-wise over the keys (a lane is a token; masked keys score -1e30). Probabilities
// are rounded to bf16 for the weighted sum, as SDPA does, and meet V in pairs of keys:
// the tile's V rows are interleaved into pairs per feature (vt[key pair][D]), and 16
// tokens' sums of a feature are one vdpbf16ps of their probability pairs with the
// feature's pair broadcast. Float32 scores, softmax and sums; exact softmax (all the
// tile's scores are kept, [keys][G][16] floats).
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
constexpr bool kPrefillTiles = true;

// Per-thread buffers of the prefill tiles, grown to the longest tile's keys.
struct PrefillScratch {
  std::vector<float> s;        // [keys][G][16] scores, then probabilities
  std::vector<uint32_t> vt;    // [key pairs][D] V pairs
  std::vector<uint32_t> qt;    // [G][D/2][16] query pairs
  std::vector<const bf16*> kr, vr;  // the keys' K and V rows (this KV head)
  void fit(int64_t keys, int32_t G, int32_t D) {
    if ((int64_t)kr.size() < keys + 1) {
      s.resize((size_t)(keys + 1) * G * 16);
      vt.resize((size_t)((keys + 2) / 2) * D);
      kr.resize(keys + 1);
      vr.resize(keys + 1);
    }
    qt.resize((size_t)G * D / 2 * 16);
  }
};

template <int D, int GB>
void prefill_tile(const bf16* q, int64_t q_row, bf16* o, int64_t o_row, const bf16* k,
                  const bf16* v, int64_t s_blk, int64_t s_off, int64_t s_head,
                  const int32_t* table, int32_t bs, int32_t h, int32_t G, int32_t nt,
                  const int32_t* firsts, const int32_t* ends, float scale, PrefillScratch& sc) {
  constexpr int P = D / 2;  // pairs of a row
  const int32_t kf = firsts[0], nk = ends[nt - 1] - kf;
  // the tile's query rows (this KV head's G heads) are in L2 or L3: fetched while the
  // key pointers below are set up (gathering them cold was 10-17% of a tile's time)
  for (int32_t i = 0; i < nt; ++i)
    for (int32_t b = 0; b < G * D * 2; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + i * q_row + (int64_t)h * G * D) + b,
                   _MM_HINT_T0);
  sc.fit(nk, G, D);
  for (int32_t t = 0, pos = kf; t < nk;) {  // block by block: no division per key
    const int32_t off = pos % bs, run = std::min(bs - off, nk - t);
    const bf16* kb = k + (int64_t)table[pos / bs] * s_blk + (int64_t)off * s_off + h * s_head;
    const bf16* vb = v + (kb - k);
    for (int32_t j = 0; j < run; ++j) sc.kr[t + j] = kb + j * s_off, sc.vr[t + j] = vb + j * s_off;
    t += run, pos += run;
  }
  // the tokens' windows, lane-wise; lanes past nt see no key
  alignas(64) int32_t fl[16], el[16];
  for (int i = 0; i < 16; ++i) fl[i] = i < nt ? firsts[i] : 0, el[i] = i < nt ? ends[i] : 0;
  const __m512i fv = _mm512_load_si512(fl), ev = _mm512_load_si512(el);
  // the query pairs, transposed by gathers: lane i of qt[g][p] is token i's pair p (0
  // past nt); q_row < 2^26 keeps the lanes' element offsets in int32
  uint32_t* qt = sc.qt.data();
  const __mmask16 tok = (__mmask16)((1u << nt) - 1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i q_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int32_t)q_row));
  for (int32_t g = 0; g < G; ++g) {
    const bf16* qg = q + (int64_t)(h * G + g) * D;
    for (int p = 0; p < P; ++p)
      _mm512_storeu_si512(qt + ((int64_t)g * P + p) * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tok, q_at,
                                                      qg + 2 * p, 2));
  }
  float* s = sc.s.data();
  const __m512 sv = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-1e30f);
  __m512 m[16];  // running max per query head (G <= 16)
  for (int32_t g = 0; g < G; ++g) m[g] = masked;
  // Keys in groups of NK, GB query heads at once: each broadcast pair of a key serves
  // GB heads (GB * NK sums in registers).
  constexpr int NK = GB == 1 ? 16 : GB == 2 ? 12 : GB == 3 ? 8 : 6;
  for (int32_t g0 = 0; g0 < G; g0 += GB) {
    const uint32_t* qg = qt + (int64_t)g0 * P * 16;
    for (int32_t t0 = 0; t0 < nk; t0 += NK) {
      const int n = std::min<int32_t>(NK, nk - t0);
      __m512 a[GB][NK];
      const auto scores = [&](auto keys) {  // a[gb][j]: key t0 + j, head g0 + gb
        constexpr int K_ = decltype(keys)::value;
        const bf16* kr[K_];
        for (int j = 0; j < K_; ++j) {
          kr[j] = sc.kr[t0 + j];
          for (int gb = 0; gb < GB; ++gb) a[gb][j] = _mm512_setzero_ps();
        }
        for (int p = 0; p < P; ++p) {
          __m512bh qv[GB];
          for (int gb = 0; gb < GB; ++gb)
            qv[gb] = (__m512bh)_mm512_loadu_si512(qg + ((int64_t)gb * P + p) * 16);
#pragma GCC unroll 16
          for (int j = 0; j < K_; ++j) {
            int32_t pair;
            std::memcpy(&pair, kr[j] + 2 * p, 4);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
            for (int gb = 0; gb < GB; ++gb) a[gb][j] = _mm512_dpbf16_ps(a[gb][j], qv[gb], kb);
          }
        }
      };
      if (n == NK) {
        scores(std::integral_constant<int, NK>{});
      } else {  // the last group: one key at a time
        for (int j0 = 0; j0 < n; ++j0) {
          const bf16* kr = sc.kr[t0 + j0];
          for (int gb = 0; gb < GB; ++gb) {
            __m512 x = _mm512_setzero_ps();
            for (int p = 0; p < P; ++p) {
              int32_t pair;
              std::memcpy(&pair, kr + 2 * p, 4);
              x = _mm512_dpbf16_ps(
                  x, (__m512bh)_mm512_loadu_si512(qg + ((int64_t)gb * P + p) * 16),
                  (__m512bh)_mm512_set1_epi32(pair));
            }
            a[gb][j0] = x;
          }
        }
      }
      for (int j = 0; j < n; ++j) {
        const __m512i pos = _mm512_set1_epi32(kf + t0 + j);
        const __mmask16 ok = _mm512_cmpge_epi32_mask(pos, fv) & _mm512_cmplt_epi32_mask(pos, ev);
        for (int gb = 0; gb < GB; ++gb) {
          const __m512 x = _mm512_mask_mov_ps(masked, ok, _mm512_mul_ps(a[gb][j], sv));
          m[g0 + gb] = _mm512_max_ps(m[g0 + gb], x);
          _mm512_storeu_ps(s + ((int64_t)(t0 + j) * G + g0 + gb) * 16, x);
        }
      }
    }
  }
  // probabilities (unnormalised) and their sums, lane-wise; an odd key count gets a
  // zero key so that keys pair up
  alignas(64) float mf[16 * 16], lf[16 * 16];
  for (int32_t g = 0; g < G; ++g) _mm512_store_ps(mf + g * 16, m[g]), _mm512_store_ps(lf + g * 16, _mm512_setzero_ps());
  for (int32_t t = 0; t < nk; ++t)
    for (int32_t g = 0; g < G; ++g) {
      float* __restrict sg = s + ((int64_t)t * G + g) * 16;
      const float* __restrict mg = mf + g * 16;
      float* __restrict lg = lf + g * 16;
      // e^(score - max) by exp16, inline (libmvec's expf, a call per 16 lanes, was 0.9%
      // of the bf16 engine bench's samples: BENCHMARKS.md, twenty-seventh round); within
      // 2 ulp of exp, and the probabilities are rounded to bf16 below. A masked key
      // (score -1e30) is 0.
      const __m512 score = _mm512_loadu_ps(sg);
      const __mmask16 live = _mm512_cmp_ps_mask(score, _mm512_set1_ps(-1e29f), _CMP_GE_OQ);
      const __m512 x = _mm512_max_ps(_mm512_sub_ps(score, _mm512_loadu_ps(mg)), _mm512_set1_ps(-80.0f));
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(x));
      _mm512_storeu_ps(sg, e);
      _mm512_storeu_ps(lg, _mm512_add_ps(_mm512_loadu_ps(lg), e));
    }
  const int32_t pairs = (nk + 1) / 2;
  if (nk % 2) {
    for (int32_t g = 0; g < G; ++g) _mm512_storeu_ps(s + ((int64_t)nk * G + g) * 16, _mm512_setzero_ps());
  }
  // probability pairs, pp[tp][g] lane i: (bf16(p[i][2tp]), bf16(p[i][2tp + 1])), in place
  // of the scores of key 2tp (each pair is read after the two rows it comes from)
  uint32_t* pp = reinterpret_cast<uint32_t*>(s);
  for (int32_t tp = 0; tp < pairs; ++tp)
    for (int32_t g = 0; g < G; ++g) {
      const __m512 p0 = _mm512_loadu_ps(s + ((int64_t)(2 * tp) * G + g) * 16);
      const __m512 p1 = _mm512_loadu_ps(s + ((int64_t)(2 * tp + 1) * G + g) * 16);
      const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
      const __m512i w1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
      _mm512_storeu_si512(pp + ((int64_t)tp * G + g) * 16,
                          _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
    }
  // V rows of each key pair interleaved per feature: vt[tp][d] = (v[2tp][d], v[2tp+1][d])
  uint32_t* vt = sc.vt.data();
  alignas(64) uint16_t lo_pick[32];  // element 2i from x0[i], 2i + 1 from x1[i]
  for (int i = 0; i < 16; ++i) lo_pick[2 * i] = i, lo_pick[2 * i + 1] = 32 + i;
  const __m512i lo_idx = _mm512_load_si512(lo_pick);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int32_t tp = 0; tp < pairs; ++tp) {
    const bf16* r0 = sc.vr[2 * tp];
    const bf16* r1 = 2 * tp + 1 < nk ? sc.vr[2 * tp + 1] : nullptr;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x0 = _mm512_loadu_si512(reinterpret_cast<const void*>(r0 + 32 * c));
      const __m512i x1 = r1 ? _mm512_loadu_si512(reinterpret_cast<const void*>(r1 + 32 * c))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + (int64_t)tp * D + 32 * c, _mm512_permutex2var_epi16(x0, lo_idx, x1));
      _mm512_storeu_si512(vt + (int64_t)tp * D + 32 * c + 16, _mm512_permutex2var_epi16(x0, hi_idx, x1));
    }
  }
  // GB heads at once, DB features: each broadcast V pair serves GB heads
  constexpr int DB = GB == 1 ? 16 : GB == 4 ? 4 : 8;
  alignas(64) uint32_t ot[GB * P * 16];  // [GB][D / 2][16] output pairs
  alignas(64) uint16_t pick[32];  // element 2i: feature j's lane i; 2i + 1: feature j + 1's
  for (int i = 0; i < 16; ++i) pick[2 * i] = i, pick[2 * i + 1] = 16 + i;
  const __m512i pair_idx = _mm512_load_si512(pick);
  const __m512i row16 = _mm512_slli_epi32(lane, 4);  // lane k: pair row k of ot
  for (int32_t g0 = 0; g0 < G; g0 += GB) {
    for (int d0 = 0; d0 < D; d0 += DB) {
      __m512 acc[GB][DB];
      for (int gb = 0; gb < GB; ++gb)
        for (int j = 0; j < DB; ++j) acc[gb][j] = _mm512_setzero_ps();
      for (int32_t tp = 0; tp < pairs; ++tp) {
        __m512bh pv[GB];
        for (int gb = 0; gb < GB; ++gb)
          pv[gb] = (__m512bh)_mm512_loadu_si512(pp + ((int64_t)tp * G + g0 + gb) * 16);
        const uint32_t* vp = vt + (int64_t)tp * D + d0;
#pragma GCC unroll 16
        for (int j = 0; j < DB; ++j) {
          const __m512bh vb = (__m512bh)_mm512_set1_epi32((int32_t)vp[j]);
          for (int gb = 0; gb < GB; ++gb) acc[gb][j] = _mm512_dpbf16_ps(acc[gb][j], pv[gb], vb);
        }
      }
      // normalised, rounded to bf16 and paired per token: ot[gb][d / 2] lane i holds
      // token i's features (d, d + 1)
      for (int gb = 0; gb < GB; ++gb) {
        const __m512 inv =
            _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(lf + (g0 + gb) * 16));
        for (int j = 0; j < DB; j += 2) {
          const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(acc[gb][j + 1], inv),
                                                           _mm512_mul_ps(acc[gb][j], inv));
          _mm512_store_si512(ot + ((int64_t)gb * P + (d0 + j) / 2) * 16,
                             _mm512_permutexvar_epi16(pair_idx, two));
        }
      }
    }
    // each token's row of each head: gathered from ot, 16 pairs (32 features) at a time
    for (int gb = 0; gb < GB; ++gb)
      for (int32_t i = 0; i < nt; ++i) {
        bf16* oi = o + i * o_row + (int64_t)(h * G + g0 + gb) * D;
        const uint32_t* og = ot + (int64_t)gb * P * 16 + i;
        for (int c = 0; c < P / 16; ++c)
          _mm512_storeu_si512(oi + 32 * c, _mm512_i32gather_epi32(row16, og + c * 256, 4));
      }
  }
}
#else
constexpr bool kPrefillTiles = false;
#endif

bool prefill_tiles_supported() { return kPrefillTiles; }

// chunks: [C, 4] int32 rows (first query row, query tokens, context length, sliding
// window or 0); tables: [C, max_blocks] int32, the chunks' block tables.
void prefill_attention(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& tables,
                       const at::Tensor& chunks, double scale) {
  TORCH_CHECK(kPrefillTiles, "prefill_attention: built without AVX-512 BF16");
  check_attention_args(q, out, k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 q, out and caches");
  const int32_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(Hq / Hkv <= 16, "prefill_attention: at most 16 query heads a KV head");
  TORCH_CHECK(D == 64 || D == 128, "prefill_attention: head_dim 64 or 128, got ", D);
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() &&
                  chunks.scalar_type() == at::kInt && chunks.is_contiguous() &&
                  chunks.dim() == 2 && chunks.size(1) == 4 && tables.size(0) == chunks.size(0),
              "prefill_attention: int32 tables [C, max_blocks] and chunks [C, 4]");
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  const int32_t G = Hq / Hkv;
  TORCH_CHECK(q.stride(0) < (1 << 26), "prefill_attention: q rows of under 2^26 elements "
              "(the tiles gather them with int32 offsets)");
  const int32_t* cp = chunks.data_ptr<int32_t>();
  const int64_t C = chunks.size(0);
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(cp[c * 4 + 1] >= 1 && cp[c * 4 + 1] <= cp[c * 4 + 2] && cp[c * 4] >= 0 &&
                    cp[c * 4] + cp[c * 4 + 1] <= q.size(0) && cp[c * 4 + 3] >= 0,
                "prefill_attention: chunk ", c, " (row ", cp[c * 4], ", ", cp[c * 4 + 1],
                " tokens, context ", cp[c * 4 + 2], ") must have 1 to context tokens within "
                "q's rows");
  // tasks (chunk, tile, KV head), the tiles with most keys first
  std::vector<std::array<int32_t, 3>> tasks;
  for (int64_t c = 0; c < C; ++c)
    for (int32_t t = 0; t < cp[c * 4 + 1]; t += 16)
      for (int32_t h = 0; h < Hkv; ++h) tasks.push_back({(int32_t)c, t, h});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) {
    const auto keys = [&](const auto& x) {  // the tile's last token's context
      const int32_t* ch = cp + x[0] * 4;
      return ch[2] - ch[1] + std::min(x[1] + 16, ch[1]);
    };
    return keys(a) > keys(b);
  });
  const int64_t s_blk = k_cache.stride(0), s_off = k_cache.stride(1), s_head = k_cache.stride(2);
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t t_row = tables.stride(0), q_row = q.stride(0), o_row = out.stride(0);
  std::atomic<int64_t> next{0};
  const int64_t n = (int64_t)tasks.size();
  const int64_t team = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    PrefillScratch sc;
    for (;;) {
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= n) break;
      const auto [c, t, h] = tasks[task];
      const int32_t* ch = cp + c * 4;
      const int32_t row0 = ch[0], q_len = ch[1], seq_len = ch[2], window = ch[3];
      const int32_t nt = std::min(16, q_len - t);
      int32_t firsts[16], ends[16];
      for (int32_t i = 0; i < nt; ++i) {
        ends[i] = seq_len - q_len + t + i + 1;  // token t + i sees [first, end)
        firsts[i] = window > 0 ? std::max(0, ends[i] - window) : 0;
      }
      const bf16* qi = qp + (int64_t)(row0 + t) * q_row;
      bf16* oi = op + (int64_t)(row0 + t) * o_row;
      const auto run = [&](auto d, auto gb) {
        prefill_tile<decltype(d)::value, decltype(gb)::value>(
            qi, q_row, oi, o_row, kp, vp, s_blk, s_off, s_head, tp + c * t_row, bs, h, G, nt,
            firsts, ends, (float)scale, sc);
      };
      using D64 = std::integral_constant<int, 64>;
      using D128 = std::integral_constant<int, 128>;
      const auto heads = [&](auto d) {  // query heads at once: the largest of 4..1 dividing G
        if (G % 4 == 0) run(d, std::integral_constant<int, 4>{});
        else if (G % 3 == 0) run(d, std::integral_constant<int, 3>{});
        else if (G % 2 == 0) run(d, std::integral_constant<int, 2>{});
        else run(d, std::integral_constant<int, 1>{});
      };
      if (D == 64) heads(D64{});
      else heads(D128{});
    }
  });
#endif
}

// ----------------------------------------------------------------- RMSNorm
//
// Reference (layers/norm.py): s = x + residual (in x's dtype); xf = float(s);
// y = weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype). One pass per row.

// One row of rms_rows for bf16 on AVX-512 BF16 builds, 16 features a step (the scalar
// loop's conversions do not vectorize): the same roundings, the sum of squares in 16
// lanes. Returns the features done (hidden rounded down to 16); the caller does the rest.
template <typename T, bool ADD>
inline int64_t rms_row_vec(const T* xi, const T* ri, T* nr, float* s, int64_t hidden,
                           float& ss) {
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    const int64_t n16 = hidden / 16 * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n16; j += 16) {
      __m512 v = load_bf16(xi + j);
      if (ADD) {
        const __m256i h = to_bf16(_mm512_add_ps(v, load_bf16(ri + j)));
        store_bf16(nr + j, h);
        v = widen_bf16(h);
      }
      _mm512_storeu_ps(s + j, v);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
    return n16;
  }
#endif
  return 0;
}

template <typename T>
inline void rms_out_vec(const float* s, const T* w, T* oi, int64_t n16, float inv) {
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < n16; j += 16) {
      const __m512 y = widen_bf16(to_bf16(_mm512_mul_ps(_mm512_loadu_ps(s + j), iv)));
      store_bf16(oi + j, to_bf16(_mm512_mul_ps(load_bf16(w + j), y)));
    }
  }
#endif
}

template <typename T, bool ADD>
void rms_rows(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t n,
              int64_t hidden, int64_t x_row, int64_t r_row, float eps) {
  at::parallel_for(0, n, row_grain(hidden), [&](int64_t b, int64_t e) {
    std::vector<float> s(hidden);
    for (int64_t i = b; i < e; ++i) {
      const T* xi = x + i * x_row;
      const T* ri = ADD ? res + i * r_row : nullptr;
      T* nr = ADD ? new_res + i * hidden : nullptr;
      T* oi = out + i * hidden;
      float ss = 0.0f;
      const int64_t v = rms_row_vec<T, ADD>(xi, ri, nr, s.data(), hidden, ss);
      if (ADD) {
        for (int64_t j = v; j < hidden; ++j) {
          const T sum = from_f<T>(to_f(xi[j]) + to_f(ri[j]));
          nr[j] = sum;
          s[j] = to_f(sum);
        }
      } else {
        for (int64_t j = v; j < hidden; ++j) s[j] = to_f(xi[j]);
      }
      for (int64_t j = v; j < hidden; ++j) ss += s[j] * s[j];
      const float inv = 1.0f / std::sqrt(ss / (float)hidden + eps);
      rms_out_vec<T>(s.data(), w, oi, v, inv);
      for (int64_t j = v; j < hidden; ++j)
        oi[j] = from_f<T>(to_f(w[j]) * to_f(from_f<T>(s[j] * inv)));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [n, hidden] with unit inner stride");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "weight must be [hidden], contiguous, in x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: float32 / bfloat16 only");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_rows<float, false>(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(),
                           out.data_ptr<float>(), nullptr, x.size(0), x.size(1), x.stride(0), 0,
                           (float)eps);
  else
    rms_rows<bf16, false>(x.data_ptr<bf16>(), nullptr, weight.data_ptr<bf16>(),
                          out.data_ptr<bf16>(), nullptr, x.size(0), x.size(1), x.stride(0), 0,
                          (float)eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto new_res = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_rows<float, true>(x.data_ptr<float>(), residual.data_ptr<float>(),
                          weight.data_ptr<float>(), out.data_ptr<float>(),
                          new_res.data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                          residual.stride(0), (float)eps);
  else
    rms_rows<bf16, true>(x.data_ptr<bf16>(), residual.data_ptr<bf16>(), weight.data_ptr<bf16>(),
                         out.data_ptr<bf16>(), new_res.data_ptr<bf16>(), x.size(0), x.size(1),
                         x.stride(0), residual.stride(0), (float)eps);
  return {out, new_res};
}

// ----------------------------------------------------------------- SiLU and mul
//
// Reference (layers/activation.py): silu(gate) * up, rounded after each op.
// oi[j] = silu(g[j]) * u[j], j < d: a row of silu_and_mul, or gate_up_silu_bf16's 32
// columns of one (they start and end at multiples of 16, so each element takes the same
// one of the two paths below as in the row; float32 goes through silu_mul_f32).
template <typename T>
inline void silu_mul_span(const T* g, const T* u, T* oi, int64_t d) {
  int64_t j = 0;
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    // 16 at a time, as torch computes silu: g * sigmoid(g), sigmoid = 1 / (1 + e^-g),
    // rounded to bf16, times up, rounded. Where float's e^-g overflows (g < -88.72)
    // torch's sigmoid is 0, so silu is -0 here too. Faster than the loop below and
    // closer to torch's F.silu(gate) * up (the loop's g / (1 + e^-g) rounds once
    // less, and differs from it in about 1 value in 1000).
    for (; j + 16 <= d; j += 16) {
      const __m512 gf = load_bf16(g + j);
      const __m512 den =
          _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gf)));
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), den);
      const __mmask16 over = _mm512_cmp_ps_mask(gf, _mm512_set1_ps(-88.7228317f), _CMP_LT_OQ);
      const __m512 act = _mm512_mul_ps(gf, _mm512_mask_mov_ps(inv, over, _mm512_setzero_ps()));
      const __m512 a = widen_bf16(to_bf16(act));
      store_bf16(oi + j, to_bf16(_mm512_mul_ps(a, load_bf16(u + j))));
    }
  }
#endif
  for (; j < d; ++j) {
    const float gf = to_f(g[j]);
    // exp's argument clamped where it overflows: -ffast-math assumes no infinities,
    // and gf / (1 + inf) came out NaN for gates below -88.7 (silu there is -0)
    const T act = from_f<T>(gf / (1.0f + std::exp(std::min(-gf, 88.3762626f))));
    oi[j] = from_f<T>(to_f(act) * to_f(u[j]));
  }
}

// float32 spans: one out-of-line copy, for silu_and_mul's rows and gate_up_silu_f32's
// blocks alike. Inlined, the compiler vectorizes the loop by call site (libmvec's expf
// in some lanes, scalar expf in others), and the two came out 1 ulp apart on AVX2.
// With 64-byte-aligned, non-overlapping g, u and o and n a multiple of 16 (the fused
// blocks always; the rows at the shapes gate_up_silu_fits), every element takes the
// vector loop in both.
__attribute__((noinline)) void silu_mul_f32(const float* g, const float* u, float* o, int64_t n) {
  silu_mul_span<float>(g, u, o, n);
}

// The loop of the fused gate_up + SiLU-and-mul kernels (gate_up_silu_bf16,
// gate_up_silu_f32), for a gate_up weight [2d, K] (gate rows first) packed in panels of
// PW columns, d a multiple of PW: gate panels 0 .. d / PW, up panels from d / PW. A
// thread computes gate panel i and up panel d / PW + i into [M, PW] buffers g and u of
// its own (64-byte aligned, in L1 / L2), then act(g, u, o, i) writes their SiLU-and-mul
// into y's columns PW i .. PW (i + 1) (o: a third such buffer, for act's use). The
// [M, 2d] gate_up output is never written out and read back, and the activation is no
// parallel region of its own. panel(j, out, next) computes panel j into out (row stride
// PW) and prefetches panel `next` (-1: none): gate panel i asks for up panel i, which
// asks for the thread's next gate panel.
template <typename T, int PW, typename Panel, typename Act>
void gate_up_pairs(int64_t M, int64_t d, const Panel& panel, const Act& act) {
  const int64_t P = d / PW;
  parallel_blocks(P, 1, [&](int64_t pb, int64_t pe, const auto& ahead) {
    constexpr int64_t A = 64 / sizeof(T);
    thread_local std::vector<T> buf;
    buf.resize((size_t)(M * 3 * PW + A));
    T* g = buf.data() + (A - (reinterpret_cast<uintptr_t>(buf.data()) / sizeof(T)) % A) % A;
    T* u = g + M * PW;
    T* o = u + M * PW;
    for (int64_t p = pb; p < pe; ++p) {
      panel(p, g, P + p);
      const int64_t pn = p + 1 < pe ? p + 1 : ahead();
      panel(P + p, u, pn < P ? pn : -1);
      act(g, u, o, p);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t n, int64_t d, int64_t x_row) {
  at::parallel_for(0, n, row_grain(2 * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if constexpr (std::is_same_v<T, float>)
        silu_mul_f32(x + i * x_row, x + i * x_row + d, out + i * d, d);
      else
        silu_mul_span(x + i * x_row, x + i * x_row + d, out + i * d, d);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [n, 2 * d] with unit inner stride");
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0), d, x.stride(0));
  else if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows<bf16>(x.data_ptr<bf16>(), out.data_ptr<bf16>(), x.size(0), d, x.stride(0));
  else
    TORCH_CHECK(false, "silu_and_mul: float32 / bfloat16 only");
  return out;
}

// ----------------------------------------------------------------- RoPE + KV store
//
// Reference (layers/rotary.py, kernels/reference.py:store_kv_ref): cos, sin =
// cos_sin[pos].to(dtype); x1 * cos - x2 * sin | x2 * cos + x1 * sin over the first
// rd features (the rest copied); K (rotated) and V converted to the cache dtype and
// written at their slot. q comes back rotated in a new [n, Hq, D] tensor.
template <typename T>
inline void rotate(const T* x, T* y, const float* cs, int32_t D, int32_t rd) {
  const int32_t half = rd / 2;
  for (int32_t j = 0; j < half; ++j) {
    const float c = to_f(from_f<T>(cs[j])), s = to_f(from_f<T>(cs[half + j]));
    const float x1 = to_f(x[j]), x2 = to_f(x[half + j]);
    const float a = to_f(from_f<T>(x1 * c)), b = to_f(from_f<T>(x2 * s));
    const float e = to_f(from_f<T>(x2 * c)), f = to_f(from_f<T>(x1 * s));
    y[j] = from_f<T>(a - b);
    y[half + j] = from_f<T>(e + f);
  }
  for (int32_t j = rd; j < D; ++j) y[j] = x[j];
}

template <typename T, typename C>
void rope_store_typed(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& cos_sin, const at::Tensor& kv_cache,
                      const at::Tensor& slots, const at::Tensor& q_out, int64_t Hq, int64_t Hkv,
                      int64_t D, int64_t rd) {
  const int64_t n = qkv.size(0), n_slots = slots.size(0), row = qkv.stride(0);
  const int64_t bs = kv_cache.size(2);
  const int64_t c_kv = kv_cache.stride(0), c_blk = kv_cache.stride(1), c_off = kv_cache.stride(2);
  const int64_t c_head = kv_cache.stride(3);
  const T* src = qkv.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  C* cache = kv_cache.data_ptr<C>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t cs_row = cos_sin.stride(0);
  at::parallel_for(0, n, row_grain((Hq + 2 * Hkv) * D), [&](int64_t b, int64_t e) {
    std::vector<T> kbuf(D);
    for (int64_t i = b; i < e; ++i) {
      const T* qi = src + i * row;
      const float* cs = table + pos[i] * cs_row;
      for (int64_t h = 0; h < Hq; ++h) rotate<T>(qi + h * D, qo + (i * Hq + h) * D, cs, D, rd);
      if (i >= n_slots || sl[i] < 0) continue;
      C* kd = cache + (sl[i] / bs) * c_blk + (sl[i] % bs) * c_off;
      const T* ki = qi + Hq * D;
      const T* vi = ki + Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        rotate<T>(ki + h * D, kbuf.data(), cs, D, rd);
        C* kh = kd + h * c_head;
        C* vh = kd + c_kv + h * c_head;
        for (int64_t j = 0; j < D; ++j) {
          kh[j] = from_f<C>(to_f(kbuf[j]));
          vh[j] = from_f<C>(to_f(vi[h * D + j]));
        }
      }
    }
  });
}

at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& positions,
                         const at::Tensor& cos_sin, const at::Tensor& kv_cache,
                         const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t rotary_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [n, (heads + 2 * kv_heads) * head_dim] with unit inner stride");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == num_kv_heads &&
                  kv_cache.size(4) == head_dim && kv_cache.stride(4) == 1,
              "kv_cache must be [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == qkv.size(0),
              "positions: int64 [n]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) <= qkv.size(0),
              "slot_mapping: int64 [<= n]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 &&
                  cos_sin.stride(1) == 1 && cos_sin.size(1) == rotary_dim &&
                  rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "cos_sin must be float32 [max_position, rotary_dim]");
  const int64_t n = qkv.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_sin.size(0), "position ", pos[i],
                " is outside the RoPE table [0, ", cos_sin.size(0), ")");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK(sl[i] < num_slots, "slot ", sl[i], " is outside the cache's ", num_slots);
  auto q = at::empty({n, num_heads, head_dim}, qkv.options());
  const auto t = qkv.scalar_type(), c = kv_cache.scalar_type();
  if (t == at::kFloat && c == at::kFloat)
    rope_store_typed<float, float>(qkv, positions, cos_sin, kv_cache, slots, q, num_heads,
                                   num_kv_heads, head_dim, rotary_dim);
  else if (t == at::kFloat && c == at::kBFloat16)
    rope_store_typed<float, bf16>(qkv, positions, cos_sin, kv_cache, slots, q, num_heads,
                                  num_kv_heads, head_dim, rotary_dim);
  else if (t == at::kBFloat16 && c == at::kBFloat16)
    rope_store_typed<bf16, bf16>(qkv, positions, cos_sin, kv_cache, slots, q, num_heads,
                                 num_kv_heads, head_dim, rotary_dim);
  else if (t == at::kBFloat16 && c == at::kFloat)
    rope_store_typed<bf16, float>(qkv, positions, cos_sin, kv_cache, slots, q, num_heads,
                                  num_kv_heads, head_dim, rotary_dim);
  else
    TORCH_CHECK(false, "rope_store_kv: float32 / bfloat16 only, got ", t, " and ", c);
  return q;
}

// ----------------------------------------------------------------- small-batch bf16 linear
//
// y = x W^T (+ bias) for decode's row counts (1 to 64 rows of x), bf16 in, bf16 out,
// float32 accumulation. torch's bf16 matmul (oneDNN's brgemm) reads the weights at
// 12-24 GB/s at these sizes, so a bf16 model decoded a few requests at a time was no
// faster than float32. Here each weight row is read once for all M rows of x with
// AVX-512 BF16 dot products (exact bf16 products, float32 sums; vdpbf16ps flushes
// denormal inputs and results to zero: the order differs from oneDNN's, the rounding
// to bf16 happens once at the end as there). 1 to 4 rows: one chunk of M rows against
// units of 16 / M weight rows (one Vec512::sums); more: chunks of 6 rows against units
// of 4 (24 lane vectors of sums, two Vec512::sums). Up to which row count it serves
// is native.bf16_linear_rows()'s choice, by CPU.
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
constexpr bool kSmallLinear = true;
// native.SMALL_LINEAR_OP_ROWS: change both together
constexpr int64_t kSmallLinearMaxRows = 64;

// One unit: R weight rows against MC rows of x (MC x R <= 32 lane vectors of sums,
// reduced 16 at a time with Vec512::sums). Rows past the weight's end (rows < R) read its last
// row again and are not stored, so R stays a constant and the loops unroll. With
// `next`, the next unit's rows are prefetched a cache line (32 bf16) per k-step.
template <int MC, int R>
inline void small_linear_unit(const bf16* x, int64_t x_row, const bf16* w, int64_t w_row,
                              int rows, int64_t K, const bf16* bias, bf16* y, int64_t y_row,
                              const bf16* next, int next_rows) {
  constexpr int NS = (MC * R + 15) / 16;  // Vec512::sums of 16 lane vectors each
  static_assert(NS <= 2, "at most 32 lane vectors of sums");
  __m512 a[NS * 16];
  for (int i = 0; i < NS * 16; ++i) a[i] = _mm512_setzero_ps();
  const bf16* wr[R];
  for (int j = 0; j < R; ++j) wr[j] = w + (int64_t)std::min(j, rows - 1) * w_row;
  for (int64_t k = 0; k < K; k += 32) {
    if (next != nullptr)
      for (int j = 0; j < next_rows; ++j) __builtin_prefetch(next + j * w_row + k, 0, 3);
    __m512bh wv[R];
    for (int j = 0; j < R; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wr[j] + k));
    for (int m = 0; m < MC; ++m) {
      const __m512bh xv =
          (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * x_row + k));
      for (int j = 0; j < R; ++j) a[m * R + j] = _mm512_dpbf16_ps(a[m * R + j], wv[j], xv);
    }
  }
  alignas(64) float out[NS * 16];
  for (int s = 0; s < NS; ++s) _mm512_store_ps(out + s * 16, Vec512::sums(a + s * 16));
  for (int m = 0; m < MC; ++m)
    for (int j = 0; j < rows; ++j)
      y[m * y_row + j] = from_f<bf16>(out[m * R + j] + (bias ? to_f(bias[j]) : 0.0f));
}

// Units of R weight rows, each read from memory once and kept in L1 while every chunk
// of MC rows of x passes over it (the chunk of the last rows may be shorter).
template <int MC, int R>
void small_linear_typed(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M,
                        int64_t N, int64_t K, int64_t x_row, int64_t w_row) {
  const int64_t units = (N + R - 1) / R;
  parallel_blocks(units, 8, [&](int64_t ub, int64_t ue, const auto&) {
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t n0 = u * R;
      const int rows = (int)std::min<int64_t>(R, N - n0);
      const bf16* wu = w + n0 * w_row;
      const bf16* next = u + 1 < ue ? wu + R * w_row : nullptr;
      const int next_rows = next ? (int)std::min<int64_t>(R, N - n0 - R) : 0;
      const bf16* bu = bias ? bias + n0 : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const bf16* xm = x + m0 * x_row;
        bf16* ym = y + m0 * N + n0;
        // the unit's rows are in L1 after the first chunk: prefetch only with it
        const bf16* nx = m0 == 0 ? next : nullptr;
        switch (std::min<int64_t>(MC, M - m0)) {
          case 1: small_linear_unit<1, R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 2: small_linear_unit<std::min(2, MC), R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 3: small_linear_unit<std::min(3, MC), R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 4: small_linear_unit<std::min(4, MC), R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 5: small_linear_unit<std::min(5, MC), R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          default: small_linear_unit<MC, R>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows);
        }
      }
    }
  });
}

// The bf16 weights packed once at load (native.pack_linear_bf16): [P, K / 2, 32, 2],
// panels of 32 output features holding K's pairs side by side (vdpbf16ps's operand
// layout: one 512-bit load is 16 features x 2 consecutive k), zeros past N. A tile of
// up to kBf16MR rows of x keeps 2 accumulators a row (16 features each) in registers;
// per pair of k it loads the panel's two vectors once and adds, for every row, the
// row's broadcast pair times them (2 vdpbf16ps a row). No horizontal sums and no x
// vector loads, where small_linear's dot products spend a load of x per vdpbf16ps and
// reduce 16 lanes per output. Exact bf16 products, float32 sums seeded with the bias,
// one rounding at the end (vcvtneps2bf16, to nearest even); the order of the additions
// differs from small_linear's and oneDNN's. Tiles of few rows have few independent
// accumulators, so they split K in two halves with their own sums (KS), added at the end.
constexpr int kBf16MR = 12;

template <int MR, int KS, typename Y>
inline void gemm_bf16_tile(const bf16* x, int64_t x_row, int rows, const bf16* bp,
                           const float* bias_p, int64_t K, Y* y, int64_t y_row, int cols,
                           const char* pf, int64_t pf_lines) {
  __m512 c[KS][2 * MR];
  const __m512 b0 = _mm512_load_ps(bias_p), b1 = _mm512_load_ps(bias_p + 16);
  for (int i = 0; i < MR; ++i) c[0][2 * i] = b0, c[0][2 * i + 1] = b1;
  for (int s = 1; s < KS; ++s)
    for (int i = 0; i < 2 * MR; ++i) c[s][i] = _mm512_setzero_ps();
  const bf16* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (int64_t)std::min(i, rows - 1) * x_row;
  const int64_t pairs = K / 2, part = (pairs + KS - 1) / KS;
  int64_t pf_acc = 0;
#pragma GCC unroll 4
  for (int s = 0; s < KS; ++s) {
    const int64_t pe = std::min(pairs, (s + 1) * part);
    for (int64_t q = s * part; q < pe; ++q) {
      const bf16* wq = bp + q * 64;
      prefetch_step(pf, pf_acc, pf_lines, pairs);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wq));
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wq + 32));
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xr[i] + 2 * q, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        c[s][2 * i] = _mm512_dpbf16_ps(c[s][2 * i], a, w0);
        c[s][2 * i + 1] = _mm512_dpbf16_ps(c[s][2 * i + 1], a, w1);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
    __m512 lo = c[0][2 * i], hi = c[0][2 * i + 1];
    for (int s = 1; s < KS; ++s) lo = _mm512_add_ps(lo, c[s][2 * i]), hi = _mm512_add_ps(hi, c[s][2 * i + 1]);
    if constexpr (std::is_same_v<Y, float>) {  // rounded to bf16, then widened
      const __m512 flo = widen_bf16(to_bf16(lo)), fhi = widen_bf16(to_bf16(hi));
      if (cols == 32) {
        _mm512_storeu_ps(y + i * y_row, flo);
        _mm512_storeu_ps(y + i * y_row + 16, fhi);
      } else {
        alignas(64) float tmp[32];
        _mm512_store_ps(tmp, flo);
        _mm512_store_ps(tmp + 16, fhi);
        for (int j = 0; j < cols; ++j) y[i * y_row + j] = tmp[j];
      }
    } else {
      const __m512i out =
          _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
      if (cols == 32) {
        _mm512_storeu_si512(reinterpret_cast<void*>(y + i * y_row), out);
      } else {
        alignas(64) bf16 tmp[32];
        _mm512_store_si512(reinterpret_cast<void*>(tmp), out);
        for (int j = 0; j < cols; ++j) y[i * y_row + j] = tmp[j];
      }
    }
  }
}

template <int MR, int KS, typename Y>
void bf16_panel_tiles(const bf16* x, int64_t x_row, int64_t M, const bf16* bp,
                      const float* bias_p, int64_t K, Y* y, int64_t N, int cols,
                      const bf16* next) {
  // the next panel: K cache lines (K / 2 pairs of 32 x 2 bf16), asked for over the pairs
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m = 0; m < M; ++t, m += MR) {
    const int rows = (int)std::min<int64_t>(MR, M - m);
    const auto pf = PanelPrefetch::share(next, K, M, t, tiles);
    gemm_bf16_tile<MR, KS>(x + m * x_row, x_row, rows, bp, bias_p, K, y + m * N, N, cols,
                           pf.p, pf.lines);
  }
}

// Y: bf16, or float32 holding the same bf16-rounded values (the LM head's logits,
// without a second pass to widen them). sink.at(n0) is where panel n0's outputs go
// (rows sink.stride() apart), sink.done(n0, cols) runs once they are there (IntoY,
// ArgmaxSink).
// The rows of a bf16 panel's tiles: M rows split into tiles as even as they go, of at
// most kBf16MR rows (16 rows: two of 8).
inline int bf16_tile_rows(int64_t M) {
  const int64_t tiles = (M + kBf16MR - 1) / kBf16MR;
  return (int)((M + tiles - 1) / tiles);
}

// One panel bp (the weight's output features n0 .. n0 + cols) for all M rows of x, in
// tiles of mr rows (bf16_tile_rows): y[m][j] (rows ys apart) = x[m] . w[n0 + j] +
// bias[n0 + j], rounded to bf16; next: the panel to ask for meanwhile (nullptr: none).
template <typename Y>
inline void bf16_panel(const bf16* x, int64_t x_row, int64_t M, int mr, const bf16* bp,
                       const bf16* bias, int64_t n0, int cols, int64_t K, Y* y, int64_t ys,
                       const bf16* next) {
  alignas(64) float bias_p[32];
  for (int j = 0; j < 32; ++j) bias_p[j] = j < cols && bias ? to_f(bias[n0 + j]) : 0.0f;
  switch (mr) {
#define SPUR_BF16_CASE(R, KS) \
  case R: bf16_panel_tiles<R, KS>(x, x_row, M, bp, bias_p, K, y, ys, cols, next); break;
    SPUR_BF16_CASE(1, 4) SPUR_BF16_CASE(2, 3) SPUR_BF16_CASE(3, 2) SPUR_BF16_CASE(4, 2)
    SPUR_BF16_CASE(5, 1) SPUR_BF16_CASE(6, 1) SPUR_BF16_CASE(7, 1) SPUR_BF16_CASE(8, 1)
    SPUR_BF16_CASE(9, 1) SPUR_BF16_CASE(10, 1) SPUR_BF16_CASE(11, 1)
#undef SPUR_BF16_CASE
    default: bf16_panel_tiles<kBf16MR, 1>(x, x_row, M, bp, bias_p, K, y, ys, cols, next);
  }
}

template <typename Y, typename Sink>
void bf16_panels_run(const bf16* x, const bf16* panels, const bf16* bias, const Sink& sink,
                     int64_t M, int64_t N, int64_t K, int64_t x_row) {
  const int64_t P = (N + 31) / 32;
  const int mr = bf16_tile_rows(M);
  parallel_blocks(P, 1, [&](int64_t pb, int64_t pe, const auto& ahead) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * 32;
      const int cols = (int)std::min<int64_t>(32, N - n0);
      // the panel after this one: this block's next, or the first of the thread's next block
      const int64_t pn = p + 1 < pe ? p + 1 : ahead();
      bf16_panel<Y>(x, x_row, M, mr, panels + p * K * 32, bias, n0, cols, K, sink.at(n0),
                    sink.stride(), pn < P ? panels + pn * K * 32 : nullptr);
      sink.done(n0, cols);
    }
  });
}

// silu(x Wg^T + bg) * (x Wu^T + bu) -> y [M, d], for a gate_up weight [2d, K] (gate
// rows first) packed in bf16 panels, d a multiple of 32 (gate_up_pairs' loop). Bit for
// bit silu_and_mul(linear_bf16_panels(x, panels, bias, 2d)): the same tiles, the same
// roundings, the same SiLU, row by row straight into y.
void gate_up_silu_bf16(const bf16* x, const bf16* panels, const bf16* bias, bf16* y, int64_t M,
                       int64_t d, int64_t K, int64_t x_row) {
  const int64_t panel = K * 32;
  const int mr = bf16_tile_rows(M);
  gate_up_pairs<bf16, 32>(
      M, d,
      [&](int64_t i, bf16* out, int64_t next) {
        bf16_panel<bf16>(x, x_row, M, mr, panels + i * panel, bias, i * 32, 32, K, out, 32,
                         next >= 0 ? panels + next * panel : nullptr);
      },
      [&](const bf16* g, const bf16* u, bf16*, int64_t p) {
        for (int64_t m = 0; m < M; ++m)
          silu_mul_span(g + m * 32, u + m * 32, y + m * d + p * 32, 32);
      });
}

template <typename Y>
void linear_bf16_panels_typed(const bf16* x, const bf16* panels, const bf16* bias, Y* y,
                              int64_t M, int64_t N, int64_t K, int64_t x_row) {
  bf16_panels_run<Y>(x, panels, bias, IntoY<Y>{y, N}, M, N, K, x_row);
}
#else
constexpr bool kSmallLinear = false;
constexpr int64_t kSmallLinearMaxRows = 0;
#endif

// ----------------------------------------------------------------- small-batch fp32 linear
//
// y = x W^T (+ bias) in float32, on CPUs with AVX2 + FMA or AVX-512. Decode's row
// counts (1 to 64 rows of x) take the units below, more rows the packed GEMM after
// them. There torch's float32 linear is MKL's sgemm, and on the AMD EPYCs of the tenth
// and twelfth rounds (BENCHMARKS.md; AVX2-only, and AVX-512 with AVX-512 BF16) it is
// slow exactly at these sizes: 4 rows cost 3.7x one, a 16-row LM head reads its
// weights at 2.6 GB/s. Which CPUs use it is native.py's choice. A unit is R weight rows (3 on AVX2, 4 on AVX-512), read once from memory
// (the next unit's rows prefetched a cache line at a time) and kept in L1 while every
// chunk of up to 4 rows of x passes over them: dot products along K, 4 x R lane
// vectors of sums (12 of AVX2's 16 ymm registers, 16 of AVX-512's 32 zmm), reduced
// with V::sums. A K that is not a multiple of the vector's width ends with a masked
// load. float32 throughout; the order of the additions differs from MKL's, as MKL's
// own differs between row counts. 64 rows of x (at most 393 KB at K = 1536) stay in
// a 512 KiB L2 beside the unit.
#ifdef SPUR_SIMD
constexpr bool kLinearF32 = true;
// more rows: linear_f32_packed (native.LINEAR_F32_UNIT_ROWS: change both together)
constexpr int64_t kLinearF32UnitRows = 64;
#ifdef SPUR_AVX512
using LinearVec = Vec512;
constexpr int kLinearR = 4;
#else
using LinearVec = Vec256;
constexpr int kLinearR = 3;
#endif

template <class V, int R, int MC>
inline void linear_f32_unit(const float* x, int64_t x_row, const float* w, int64_t w_row,
                            int rows, int64_t K, const float* bias, float* y, int64_t y_row,
                            const float* next, int64_t next_rows) {
  constexpr int W = V::W, NS = (4 * R + W - 1) / W;  // NS reductions of W sums each
  typename V::T a[NS * W];
  for (int i = 0; i < NS * W; ++i) a[i] = V::zero();
  const float* wr[R];
  for (int j = 0; j < R; ++j) wr[j] = w + (int64_t)std::min(j, rows - 1) * w_row;
  auto step = [&](int64_t k, auto load) {
    if (next != nullptr && (k & 15) == 0)
      for (int j = 0; j < next_rows; ++j) __builtin_prefetch(next + j * w_row + k, 0, 3);
    typename V::T wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load(wr[j] + k);
    for (int m = 0; m < MC; ++m) {
      const typename V::T xv = load(x + m * x_row + k);
      for (int j = 0; j < R; ++j) a[m * R + j] = V::fmadd(wv[j], xv, a[m * R + j]);
    }
  };
  int64_t k = 0;
  for (; k + W <= K; k += W) step(k, [](const float* p) { return V::load(p); });
  if (k < K) {
    const int32_t n = (int32_t)(K - k);
    step(k, [n](const float* p) { return V::load_first(p, n); });
  }
  alignas(64) float out[NS * W];
  for (int s = 0; s < NS; ++s) V::store(out + s * W, V::sums(a + s * W));
  for (int m = 0; m < MC; ++m)
    for (int j = 0; j < rows; ++j) y[m * y_row + j] = out[m * R + j] + (bias ? bias[j] : 0.0f);
}

void linear_f32_typed(const float* x, const float* w, const float* bias, float* y, int64_t M,
                      int64_t N, int64_t K, int64_t x_row, int64_t w_row) {
  using V = LinearVec;
  constexpr int R = kLinearR;
  const int64_t units = (N + R - 1) / R;
  parallel_blocks(units, 16, [&](int64_t ub, int64_t ue, const auto&) {
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t n0 = u * R;
      const int rows = (int)std::min<int64_t>(R, N - n0);
      const float* wu = w + n0 * w_row;
      const float* next = u + 1 < ue ? wu + R * w_row : nullptr;
      const int64_t next_rows = next ? std::min<int64_t>(R, N - n0 - R) : 0;
      const float* bu = bias ? bias + n0 : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * x_row;
        float* ym = y + m0 * N + n0;
        // the unit's rows are in L1 after the first chunk: prefetch only with it
        const float* nx = m0 == 0 ? next : nullptr;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: linear_f32_unit<V, R, 1>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 2: linear_f32_unit<V, R, 2>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          case 3: linear_f32_unit<V, R, 3>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows); break;
          default: linear_f32_unit<V, R, 4>(xm, x_row, wu, w_row, rows, K, bu, ym, N, nx, next_rows);
        }
      }
    }
  });
}

// Past 64 rows (prefill chunks) the units above run out of L2 for x, and MKL's sgemm
// is as slow on AMD (about 190 GFLOP/s on two Zen 5 cores at 2048 rows, well under
// half their FMA peak). This is the textbook register-blocked GEMM: a panel of 2 x W
// columns of y (32 on AVX-512, 16 on AVX2) has its weight rows packed k-major into an
// L2 buffer ([K][2W], zeros past N), once per panel; tiles of up to MR rows of x by the
// panel keep their MR x 2 accumulators in registers (24 zmm of 32, 12 ymm of 16) and
// per k add two weight vectors times one broadcast x element per row, for every tile
// of x (read in place, from L2 / L3). The bias seeds the accumulators. float32
// throughout; the order of the additions along K is the plain one. (Walking x in
// L2-sized chunks instead, with each panel packed again per chunk, was 3x slower at
// K = 1536: the packing's transposing writes cost more than the chunk's FMAs.)
constexpr int kPackMR = LinearVec::W == 16 ? 12 : 6;

template <class V, int MR>
inline void gemm_f32_tile(const float* x, int64_t x_row, int rows, const float* bp,
                          const float* bias_p, int64_t K, float* y, int64_t y_row, int cols,
                          const char* pf, int64_t pf_lines) {
  constexpr int W = V::W;
  typename V::T c[2 * MR];
  const typename V::T b0 = V::load(bias_p), b1 = V::load(bias_p + W);
  for (int i = 0; i < MR; ++i) c[2 * i] = b0, c[2 * i + 1] = b1;
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (int64_t)std::min(i, rows - 1) * x_row;
  int64_t pf_acc = 0;
  for (int64_t k = 0; k < K; ++k, bp += 2 * W) {
    prefetch_step(pf, pf_acc, pf_lines, K);
    const typename V::T w0 = V::load(bp), w1 = V::load(bp + W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const typename V::T a = V::set1(xr[i][k]);
      c[2 * i] = V::fmadd(a, w0, c[2 * i]);
      c[2 * i + 1] = V::fmadd(a, w1, c[2 * i + 1]);
    }
  }
  // constant indices into c (a loop to `rows` would keep c on the stack in the k loop)
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
    if (cols == 2 * W) {
      V::store(y + i * y_row, c[2 * i]);
      V::store(y + i * y_row + W, c[2 * i + 1]);
    } else {
      alignas(64) float out[2 * W];
      V::store(out, c[2 * i]);
      V::store(out + W, c[2 * i + 1]);
      for (int j = 0; j < cols; ++j) y[i * y_row + j] = out[j];
    }
  }
}

template <class V, int MR>
void panel_tiles(const float* x, int64_t x_row, int64_t M, const float* bp, const float* bias_p,
                 int64_t K, float* y, int64_t N, int cols, const float* next) {
  // the next panel: K rows of 2 x W floats, asked for over the k steps
  const int64_t tiles = (M + MR - 1) / MR;
  const int64_t lines = K * 2 * V::W * (int64_t)sizeof(float) / 64;
  for (int64_t t = 0, m = 0; m < M; ++t, m += MR) {
    const int rows = (int)std::min<int64_t>(MR, M - m);
    const auto pf = PanelPrefetch::share(next, lines, M, t, tiles);
    gemm_f32_tile<V, MR>(x + m * x_row, x_row, rows, bp, bias_p, K, y + m * N, N, cols,
                         pf.p, pf.lines);
  }
}

// y[:, n0 : n0 + cols] for one panel bp ([K][PW], packed) and all M rows of x. The
// rows are split into tiles of at most kPackMR, as even as they go (16 rows: two of
// 8), so no tile computes rows it throws away; the first tile reads the panel, the
// later ones find it in L2 (K x PW floats: 72 KiB at K = 576, 192 KiB at K = 1536).
void panel_product(const float* x, int64_t x_row, int64_t M, const float* bp, const float* bias,
                   int64_t n0, int cols, int64_t K, float* yp, int64_t N,
                   const float* next = nullptr) {
  using V = LinearVec;
  constexpr int PW = 2 * V::W;
  alignas(64) float bias_p[PW];
  for (int j = 0; j < PW; ++j) bias_p[j] = j < cols && bias ? bias[n0 + j] : 0.0f;
  const int64_t tiles = (M + kPackMR - 1) / kPackMR;
  switch ((M + tiles - 1) / tiles) {
#define SPUR_PANEL_CASE(R) \
  case R: panel_tiles<V, (R <= kPackMR ? R : kPackMR)>(x, x_row, M, bp, bias_p, K, yp, N, cols, next); break;
    SPUR_PANEL_CASE(1) SPUR_PANEL_CASE(2) SPUR_PANEL_CASE(3) SPUR_PANEL_CASE(4)
    SPUR_PANEL_CASE(5) SPUR_PANEL_CASE(6) SPUR_PANEL_CASE(7) SPUR_PANEL_CASE(8)
    SPUR_PANEL_CASE(9) SPUR_PANEL_CASE(10) SPUR_PANEL_CASE(11)
#undef SPUR_PANEL_CASE
    default: panel_tiles<V, kPackMR>(x, x_row, M, bp, bias_p, K, yp, N, cols, next);
  }
}

void linear_f32_packed(const float* x, const float* w, const float* bias, float* y, int64_t M,
                       int64_t N, int64_t K, int64_t x_row, int64_t w_row) {
  constexpr int PW = 2 * LinearVec::W;
  const int64_t panels = (N + PW - 1) / PW;
  at::parallel_for(0, panels, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> packed((size_t)K * PW);
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * PW;
      const int cols = (int)std::min<int64_t>(PW, N - n0);
      float* bp = packed.data();
      for (int j = 0; j < PW; ++j) {
        if (j < cols) {
          const float* wr = w + (n0 + j) * w_row;
          for (int64_t k = 0; k < K; ++k) bp[k * PW + j] = wr[k];
        } else {
          for (int64_t k = 0; k < K; ++k) bp[k * PW + j] = 0.0f;
        }
      }
      panel_product(x, x_row, M, bp, bias, n0, cols, K, y + n0, N);
    }
  });
}

// The same panels packed once, at load (native.pack_linear_f32): [P, K, PW] of PW = 2 x
// W columns, k-major, zeros past N; every row count (decode's and prefill's) reads
// them. Each panel is read from memory once, in address order, and asked for into L2
// while the panel before it is computed (panel_tiles): with the hardware's stream
// prefetch alone, 8-64 rows ran 1.1-1.3x slower on AVX-512 and 1.14-1.5x on AVX2
// (BENCHMARKS.md, thirty-ninth round). No horizontal sums: every FMA adds a broadcast x
// element times PW weights.
template <typename Sink>
void f32_panels_run(const float* x, const float* panels, const float* bias, const Sink& sink,
                    int64_t M, int64_t N, int64_t K, int64_t x_row) {
  constexpr int PW = 2 * LinearVec::W;
  const int64_t P = (N + PW - 1) / PW;
  parallel_blocks(P, 1, [&](int64_t pb, int64_t pe, const auto& ahead) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * PW;
      const int cols = (int)std::min<int64_t>(PW, N - n0);
      // the panel after this one: this block's next, or the first of the thread's next
      const int64_t pn = p + 1 < pe ? p + 1 : ahead();
      panel_product(x, x_row, M, panels + p * K * PW, bias, n0, cols, K, sink.at(n0),
                    sink.stride(), pn < P ? panels + pn * K * PW : nullptr);
      sink.done(n0, cols);
    }
  });
}

void linear_f32_panels_typed(const float* x, const float* panels, const float* bias, float* y,
                             int64_t M, int64_t N, int64_t K, int64_t x_row) {
  f32_panels_run(x, panels, bias, IntoY<float>{y, N}, M, N, K, x_row);
}

// gate_up_silu_bf16's float32 counterpart, over float32 panels of PW columns (d a
// multiple of PW; gate_up_pairs' loop): each pair's SiLU-and-mul in one silu_mul_f32
// call on the aligned buffers (bit-equal to silu_and_mul's rows; see silu_mul_f32),
// copied into y's columns PW i .. PW (i + 1).
void gate_up_silu_f32(const float* x, const float* panels, const float* bias, float* y,
                      int64_t M, int64_t d, int64_t K, int64_t x_row) {
  constexpr int PW = 2 * LinearVec::W;
  const int64_t panel = K * PW;
  gate_up_pairs<float, PW>(
      M, d,
      [&](int64_t i, float* out, int64_t next) {
        panel_product(x, x_row, M, panels + i * panel, bias, i * PW, PW, K, out, PW,
                      next >= 0 ? panels + next * panel : nullptr);
      },
      [&](const float* g, const float* u, float* o, int64_t p) {
        silu_mul_f32(g, u, o, M * PW);
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(y + m * d + p * PW, o + m * PW, PW * sizeof(float));
      });
}
#else
constexpr bool kLinearF32 = false;
#endif

// The checks both small-batch linears share: x [M, K] and weight [N, K] of `dtype`
// with unit inner strides, K a multiple of `k_multiple`, 1 to `max_rows` rows, and an
// optional contiguous bias [N] of `dtype`. Returns the bias's data, or nullptr.
const void* check_small_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                               const char* dtype_name, int64_t k_multiple, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, op, ": ", dtype_name,
              " only");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, op, ": unit inner strides");
  TORCH_CHECK(x.size(1) % k_multiple == 0, op, ": K must be a multiple of ", k_multiple);
  TORCH_CHECK(x.size(0) >= 1, op, ": at least one row of x");
  TORCH_CHECK(x.size(0) <= max_rows, op, ": 1 to ", max_rows, " rows");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() &&
                  bias->numel() == weight.size(0),
              op, ": bias [N] ", dtype_name);
  return bias->data_ptr();
}

bool linear_f32_supported() { return kLinearF32; }

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kLinearF32, "linear_f32: built for a CPU without AVX2 + FMA or AVX-512");
  const auto* b = static_cast<const float*>(
      check_small_linear("linear_f32", x, weight, bias, at::kFloat, "float32", 8, INT64_MAX));
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
#ifdef SPUR_SIMD
  (M <= kLinearF32UnitRows ? linear_f32_typed : linear_f32_packed)(
      x.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K,
      x.stride(0), weight.stride(0));
#endif
  return y;
}

int64_t linear_f32_panel_width() {
#ifdef SPUR_SIMD
  return 2 * LinearVec::W;
#else
  return 0;
#endif
}

// The checks of the float32 panel kernels (linear_f32_panels, gate_up_silu,
// panels_argmax): x [M, K] float32, M >= 1, with a unit inner stride, panels
// [ceil(n / PW), K, PW] in native.pack_linear_f32's layout, and an optional contiguous
// bias [n] float32. Returns the bias's data, or nullptr.
const float* check_f32_panels(const char* op, const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t PW = linear_f32_panel_width();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(0) >= 1,
              op, ": x [M, K] float32 with a unit inner stride");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == PW &&
                  panels.size(0) == (n + PW - 1) / PW,
              op, ": x [M, K] and panels [ceil(n / ", PW, "), K, ", PW,
              "] float32, contiguous (native.pack_linear_f32's layout)");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": bias [n] float32");
  return bias->data_ptr<float>();
}

at::Tensor linear_f32_panels(const at::Tensor& x, const at::Tensor& panels,
                             const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(kLinearF32, "linear_f32_panels: built for a CPU without AVX2 + FMA or AVX-512");
  const float* b = check_f32_panels("linear_f32_panels", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
#ifdef SPUR_SIMD
  linear_f32_panels_typed(x.data_ptr<float>(), panels.data_ptr<float>(), b, y.data_ptr<float>(), M,
                          n, K, x.stride(0));
#endif
  return y;
}

bool small_linear_supported() { return kSmallLinear; }

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kSmallLinear, "small_linear: built without AVX-512 BF16");
  const auto* b = static_cast<const bf16*>(
      check_small_linear("small_linear", x, weight, bias, at::kBFloat16, "bfloat16", 32,
                         kSmallLinearMaxRows));
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t xr = x.stride(0), wr = weight.stride(0);
  // 1 to 4 rows: one chunk, 16 / M weight rows a unit; more: chunks of 6 rows, 4 a unit
  switch (M) {
    case 1: small_linear_typed<1, 16>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 2: small_linear_typed<2, 8>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 3: small_linear_typed<3, 5>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 4: small_linear_typed<4, 4>(xp, wp, b, yp, M, N, K, xr, wr); break;
    default: small_linear_typed<6, 4>(xp, wp, b, yp, M, N, K, xr, wr); break;
  }
#endif
  return y;
}

// The checks of the bf16 panel kernels (linear_bf16_panels, gate_up_silu,
// panels_argmax): x [M, K] bfloat16, M >= 1, with a unit inner stride and an even K,
// panels [ceil(n / 32), K / 2, 32, 2] in native.pack_linear_bf16's layout, and an
// optional contiguous bias [n] bfloat16. Returns the bias's data, or nullptr.
const bf16* check_bf16_panels(const char* op, const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(0) >= 1 && x.size(1) % 2 == 0,
              op, ": x [M, K] bfloat16 with a unit inner stride and an even K");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous() && panels.size(0) == (n + 31) / 32 &&
                  panels.size(1) == x.size(1) / 2 && panels.size(2) == 32 && panels.size(3) == 2,
              op, ": x [M, K] and panels [ceil(n / 32), K / 2, 32, 2] bfloat16, contiguous "
              "(native.pack_linear_bf16's layout)");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
              op, ": bias [n] bfloat16");
  return bias->data_ptr<bf16>();
}

at::Tensor linear_bf16_panels(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n,
                              bool float_out = false) {
  TORCH_CHECK(kSmallLinear, "linear_bf16_panels: built without AVX-512 BF16");
  const bf16* b = check_bf16_panels("linear_bf16_panels", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  if (float_out)
    linear_bf16_panels_typed(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<float>(),
                             M, n, K, x.stride(0));
  else
    linear_bf16_panels_typed(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<bf16>(),
                             M, n, K, x.stride(0));
#endif
  return y;
}

// Whether this build's gate_up_silu takes `panels` (bf16: [P, K / 2, 32, 2]; float32:
// [P, K, PW]) of n gate and up features: n / 2 must be a whole number of panels, so
// that no panel mixes gate and up columns.
bool gate_up_silu_fits(const at::Tensor& panels, int64_t n) {
  if (panels.dim() == 4) return kSmallLinear && n > 0 && n % 64 == 0;
  return kLinearF32 && n > 0 && n % (2 * linear_f32_panel_width()) == 0;
}

// gate_up_silu(x [M, K], panels, bias [n]?, n) -> silu_and_mul(linear_*_panels(x,
// panels, bias, n)) [M, n / 2] (gate_up_silu_bf16, gate_up_silu_f32).
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t n) {
  const bool bf = panels.dim() == 4;
  TORCH_CHECK(bf ? kSmallLinear : kLinearF32, "gate_up_silu: this build has no ",
              bf ? "bf16" : "float32", " panels (use the linear and silu_and_mul)");
  TORCH_CHECK(gate_up_silu_fits(panels, n), "gate_up_silu: n (gate and up features) must be a "
              "multiple of 2 x the panel width (", bf ? 32 : linear_f32_panel_width(),
              "); otherwise use the linear and silu_and_mul");
  if (bf) {
    const bf16* b = check_bf16_panels("gate_up_silu", x, panels, bias, n);
    const int64_t M = x.size(0), K = x.size(1);
    auto y = at::empty({M, n / 2}, x.options());
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
    gate_up_silu_bf16(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<bf16>(), M,
                      n / 2, K, x.stride(0));
#endif
    return y;
  }
  const float* b = check_f32_panels("gate_up_silu", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n / 2}, x.options());
#ifdef SPUR_SIMD
  gate_up_silu_f32(x.data_ptr<float>(), panels.data_ptr<float>(), b, y.data_ptr<float>(), M,
                   n / 2, K, x.stride(0));
#endif
  return y;
}

// ----------------------------------------------------------------- greedy pick
//
// argmax_rows(x [m, V] float32) -> [m] int64: the index of each row's first maximal
// value, exactly torch's argmax (NaN counts as the largest: a row with one gives its
// first NaN's index; rows of -inf give 0). torch's max(dim=-1) took 0.47-1.02 ms a step
// over the LM head's logits at 36 rows of SmolLM2's 49152 (this: 0.14). Rows in
// parallel; within a row 16 lanes keep their own first maximum, the lanes merge by
// value, then by the lowest index. NaN is found from the bits (this file is built
// with -ffast-math, under which comparisons may assume there is none).
inline bool is_nan_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return (b & 0x7fffffffu) > 0x7f800000u;
}

int64_t argmax_row(const float* x, int64_t V) {
  int64_t j = 0, best_i = 0;
  float best = x[0];
  bool nan = false;
#ifdef SPUR_AVX512
  if (V >= 32) {
    __m512 bv = _mm512_loadu_ps(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = bi;
    const __m512i step = _mm512_set1_epi32(16), abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
    __mmask16 nans = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(_mm512_castps_si512(bv), abs_mask), inf_bits);
    for (j = 16; j + 16 <= V; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      idx = _mm512_add_epi32(idx, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, idx);
      nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask),
                                      inf_bits);
    }
    if (nans) {
      nan = true;
    } else {
      alignas(64) float vals[16];
      alignas(64) int32_t ids[16];
      _mm512_store_ps(vals, bv);
      _mm512_store_si512(reinterpret_cast<void*>(ids), bi);
      best = vals[0];
      best_i = ids[0];
      for (int l = 1; l < 16; ++l)
        if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) best = vals[l], best_i = ids[l];
    }
  }
#endif
  if (!nan) {
    for (; j < V; ++j) {
      if (is_nan_bits(x[j])) {
        nan = true;
        break;
      }
      if (x[j] > best) best = x[j], best_i = j;
    }
  }
  if (nan)  // the first NaN, wherever the scan found one
    for (int64_t k = 0; k < V; ++k)
      if (is_nan_bits(x[k])) return k;
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [m, V] float32 with unit inner stride and V > 0");
  TORCH_CHECK(x.size(1) < (int64_t)1 << 31, "argmax_rows: V must fit int32");
  const int64_t m = x.size(0), V = x.size(1), row = x.stride(0);
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / V), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[i] = argmax_row(xp + i * row, V);
  });
  return out;
}

// ----------------------------------------------------------------- greedy LM head
//
// panels_argmax(x [M, K], panels, n) -> [M] int64: argmax_rows(linear_panels_float(x,
// panels, None, n)) bit for bit (the first maximal logit, NaN the largest, rows of -inf
// 0), the greedy tokens of an LM head without its [M, n] logits: the panels' outputs
// go to a buffer of one panel a thread ([M, W] floats, in L1) and are folded into 16
// lanes a row of first maxima, panel by panel in ascending order (a thread's blocks
// ascend); lanes and threads then merge by value, then by the lowest index, as
// argmax_row's lanes do. A greedy step so writes no float32 logits and reads none back
// (BENCHMARKS.md, thirty-ninth round). AVX-512 builds only (native.py asks first).
#ifdef SPUR_AVX512
constexpr bool kPanelsArgmax = true;

struct ArgmaxLanes {
  std::vector<float> buf, v;     // [M, W] one panel's outputs; [M, 16] lane maxima
  std::vector<int32_t> i, nan;   // [M, 16] their indices; [M] first NaN (INT32_MAX: none)
  void fit(int64_t M, int W) {
    buf.assign((size_t)(M * W), 0.0f);
    const uint32_t neg_inf = 0xff800000u;  // -inf (this file is built with -ffast-math)
    float lowest;
    std::memcpy(&lowest, &neg_inf, sizeof(lowest));
    v.assign((size_t)(M * 16), lowest);
    i.assign((size_t)(M * 16), INT32_MAX);
    nan.assign((size_t)M, INT32_MAX);
  }
};

struct ArgmaxSink {
  std::vector<ArgmaxLanes>* lanes;
  int64_t M;
  int W;
  float* at(int64_t) const { return (*lanes)[at::get_thread_num()].buf.data(); }
  int64_t stride() const { return W; }
  void done(int64_t n0, int cols) const {
    ArgmaxLanes& a = (*lanes)[at::get_thread_num()];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
    for (int64_t m = 0; m < M; ++m) {
      const float* row = a.buf.data() + m * W;
      __m512 bv = _mm512_loadu_ps(a.v.data() + m * 16);
      __m512i bi = _mm512_loadu_si512(a.i.data() + m * 16);
      for (int h = 0; 16 * h < cols; ++h) {
        const int left = cols - 16 * h;
        const __mmask16 valid = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(valid, row + 16 * h);
        const __mmask16 nans = valid & _mm512_cmpgt_epi32_mask(
            _mm512_and_si512(_mm512_castps_si512(x), abs_mask), inf_bits);
        if (nans) {
          const int32_t k = (int32_t)(n0 + 16 * h + __builtin_ctz(nans));
          if (k < a.nan[m]) a.nan[m] = k;
        }
        // strictly greater: a lane keeps its first maximum (its values come in order);
        // from -inf, so a lane of -inf keeps no index (a row of them gives 0)
        const __mmask16 take = valid & _mm512_cmp_ps_mask(x, bv, _CMP_GT_OQ);
        bv = _mm512_mask_mov_ps(bv, take, x);
        bi = _mm512_mask_mov_epi32(bi, take, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(n0 + 16 * h))));
      }
      _mm512_storeu_ps(a.v.data() + m * 16, bv);
      _mm512_storeu_si512(a.i.data() + m * 16, bi);
    }
  }
};
#else
constexpr bool kPanelsArgmax = false;
#endif

bool panels_argmax_supported() { return kPanelsArgmax; }

at::Tensor panels_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(kPanelsArgmax, "panels_argmax: built without AVX-512 (native.py checks "
              "panels_argmax_supported first)");
  TORCH_CHECK(n >= 1 && n < ((int64_t)1 << 31), "panels_argmax: n must be in [1, 2^31)");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
#ifdef SPUR_AVX512
  const bool bf = panels.dim() == 4;
  const int W = bf ? 32 : (int)linear_f32_panel_width();
  if (bf) {
    TORCH_CHECK(kSmallLinear, "panels_argmax: bf16 panels need a build with AVX-512 BF16");
    check_bf16_panels("panels_argmax", x, panels, std::nullopt, n);
  } else {
    check_f32_panels("panels_argmax", x, panels, std::nullopt, n);
  }
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<ArgmaxLanes> lanes(std::max<int64_t>(at::get_num_threads(), 1));
  for (auto& a : lanes) a.fit(M, W);
  const ArgmaxSink sink{&lanes, M, W};
  if (bf) {
#ifdef __AVX512BF16__
    bf16_panels_run<float>(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), nullptr, sink, M, n, K,
                           x.stride(0));
#endif
  } else {
    f32_panels_run(x.data_ptr<float>(), panels.data_ptr<float>(), nullptr, sink, M, n, K,
                   x.stride(0));
  }
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    int32_t nan = INT32_MAX, best_i = INT32_MAX;
    float best = 0.0f;
    for (const auto& a : lanes) {
      nan = std::min(nan, a.nan[m]);
      for (int l = 0; l < 16; ++l) {
        const int32_t id = a.i[m * 16 + l];
        if (id == INT32_MAX) continue;
        const float val = a.v[m * 16 + l];
        if (best_i == INT32_MAX || val > best || (val == best && id < best_i)) best = val, best_i = id;
      }
    }
    op[m] = nan != INT32_MAX ? nan : best_i != INT32_MAX ? best_i : 0;
  }
#endif
  return out;
}

// Rows `ids` of a weight packed into panels (an embedding lookup on a tied LM head's
// weight): bf16 [P, K / 2, W, 2] (a pair of bf16 as one 32-bit word) or float32
// [P, K, W], W output features a panel; row id is lane id % W of panel id / W, its
// K / 2 (K) words W apart. -> [n, K] in the panels' dtype, bit for bit those rows.
// A step's embedding lookup, its rows cold after the LM head streamed the weight:
// 27-37 us at 16-64 rows against 81-106 us for torch's advanced indexing of the
// same words (BENCHMARKS.md, thirty-eighth round).
at::Tensor panel_rows(const at::Tensor& panels, const at::Tensor& ids) {
  const bool bf16 = panels.dim() == 4;
  TORCH_CHECK(panels.is_contiguous() &&
                  ((bf16 && panels.scalar_type() == at::kBFloat16 && panels.size(3) == 2) ||
                   (panels.dim() == 3 && panels.scalar_type() == at::kFloat)),
              "panel_rows: panels must be contiguous bf16 [P, K / 2, W, 2] or float32 [P, K, W]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "panel_rows: ids must be a contiguous int64 vector");
  const int64_t P = panels.size(0), R = panels.size(1), W = panels.size(2), n = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < P * W, "panel_rows: id ", ip[i], " outside [0, ",
                P * W, ")");
  at::Tensor out = at::empty({n, bf16 ? 2 * R : R}, panels.options());
  const int32_t* src = reinterpret_cast<const int32_t*>(panels.data_ptr());
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int32_t* s = src + (ip[i] / W) * R * W + ip[i] % W;
      int32_t* d = dst + i * R;
      for (int64_t r = 0; r < R; ++r) d[r] = s[r * W];
    }
  });
  return out;
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

// ------------------------------------------------------------------ decoder stack
//
// Every layer of a Llama decoder (models/llama_stack.py) in one call: the ops above, in
// the order and with the arguments the layers' Python would pass them, so the results
// are theirs bit for bit. Called once a step instead of ~9 ops a layer from Python: no
// Python between the ops, and the GIL is released once for the whole forward (served,
// Serve's threads in the same process take it between ops, and the step thread then
// waits to get it back). One pair of ops is fused: where gate_up_silu_fits, gate_up and
// SiLU-and-mul are gate_up_silu (the same bits; 1.02-1.03x on the engine's bf16
// workload: BENCHMARKS.md, fortieth round). The caller has checked what the per-op
// Python would have (dtypes, strides, the attention layout); each op still checks its
// own arguments.
// Per layer l: norms[2l], norms[2l + 1] (input, post-attention); panels[4l .. 4l + 3]
// and out_features (qkv, o, gate_up, down; packed float32 or bf16 panels, one kind);
// biases[4l], biases[4l + 2] (qkv, gate_up; o and down have none here). The decode plan
// (tables, rows, firsts, lens) and the prefill-tile plan (tile_tables, tile_chunks) are
// those of native.py, either absent. Rows from num_actual on are padding (zeroed before
// attention, as paged_attention does). Returns (last block's output, residual).
std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos_sin,
    at::TensorList kv_caches, const at::Tensor& slots, at::TensorList norms,
    at::TensorList panels, at::IntArrayRef out_features,
    const c10::List<std::optional<at::Tensor>>& biases, at::ArrayRef<double> eps,
    const std::optional<at::Tensor>& tables, const std::optional<at::Tensor>& rows,
    const std::optional<at::Tensor>& firsts, const std::optional<at::Tensor>& lens,
    const std::optional<at::Tensor>& tile_tables, const std::optional<at::Tensor>& tile_chunks,
    int64_t num_actual, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t rotary_dim, double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(panels.size()) == 4 * L &&
                  static_cast<int64_t>(out_features.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(eps.size()) == 2 * L,
              "decoder_stack: per layer 2 norms, 4 panels, 4 out_features, 4 biases, 2 eps");
  const bool decodes = tables.has_value();
  TORCH_CHECK(decodes == rows.has_value() && decodes == firsts.has_value() &&
                  decodes == lens.has_value() && tile_tables.has_value() == tile_chunks.has_value(),
              "decoder_stack: a plan is given whole or not at all");
  const int64_t n = hidden.size(0);
  TORCH_CHECK(num_actual >= 0 && num_actual <= n, "decoder_stack: num_actual outside [0, n]");
  const int64_t q_size = num_heads * head_dim;
  const bool bf16 = panels[0].dim() == 4;
  auto linear = [&](const at::Tensor& x, int64_t i) {
    const std::optional<at::Tensor> bias = biases.get(i);
    return bf16 ? linear_bf16_panels(x, panels[i], bias, out_features[i])
                : linear_f32_panels(x, panels[i], bias, out_features[i]);
  };
  at::Tensor h = hidden, residual, x;
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(!biases.get(4 * l + 1).has_value() && !biases.get(4 * l + 3).has_value(),
                "decoder_stack: o_proj and down_proj take no bias here");
    if (l == 0) {
      residual = h;
      x = rms_norm(h, norms[0], eps[0]);
    } else {
      std::tie(x, residual) = fused_add_rms_norm(h, residual, norms[2 * l], eps[2 * l]);
    }
    const at::Tensor& kv = kv_caches[l];
    const at::Tensor qkv = linear(x, 4 * l);
    const at::Tensor q = rope_store_kv(qkv, positions, cos_sin, kv, slots, num_heads,
                                       num_kv_heads, head_dim, rotary_dim);
    at::Tensor out = at::empty_like(q);
    if (num_actual < n) out.narrow(0, num_actual, n - num_actual).zero_();
    const at::Tensor k_cache = kv.select(0, 0), v_cache = kv.select(0, 1);
    if (tile_tables.has_value())
      prefill_attention(q, out, k_cache, v_cache, *tile_tables, *tile_chunks, scale);
    if (decodes)
      decode_attention(q, out, k_cache, v_cache, *tables, *rows, *firsts, *lens, scale, 0);
    h = linear(out.view({n, q_size}), 4 * l + 1);
    std::tie(x, residual) = fused_add_rms_norm(h, residual, norms[2 * l + 1], eps[2 * l + 1]);
    // SiLU in the gate_up panels' epilogue where it can (bit for bit the same)
    const int64_t gu = 4 * l + 2;
    h = linear(gate_up_silu_fits(panels[gu], out_features[gu])
                   ? gate_up_silu(x, panels[gu], biases.get(gu), out_features[gu])
                   : silu_and_mul(linear(x, gu)),
               4 * l + 3);
  }
  return {h, residual};
}

}  // namespace

TORCH_LIBRARY(spur_cpu, m) {
  m.def("parallel_team(int n) -> int", &parallel_team);  // no tensors: a catch-all
  m.def(
      "decode_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, "
      "Tensor tables, Tensor rows, Tensor firsts, Tensor lens, float scale, int lanes=0) -> ()");
  m.def("decode_lanes() -> int[]", &decode_lanes);
  m.def("prefill_tiles_supported() -> bool", &prefill_tiles_supported);
  m.def(
      "prefill_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, "
      "Tensor tables, Tensor chunks, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
        "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gate_up_silu(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("panel_rows(Tensor panels, Tensor ids) -> Tensor");
  m.def("panels_argmax_supported() -> bool", &panels_argmax_supported);
  m.def("panels_argmax(Tensor x, Tensor panels, int n) -> Tensor");
  m.def("small_linear_supported() -> bool", &small_linear_supported);
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_f32_supported() -> bool", &linear_f32_supported);
  m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_f32_panel_width() -> int", &linear_f32_panel_width);
  m.def("linear_f32_panels(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("linear_bf16_panels(Tensor x, Tensor panels, Tensor? bias, int n, bool float_out=False) "
        "-> Tensor");
  m.def(
      "rope_store_kv(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) kv_cache, "
      "Tensor slots, int num_heads, int num_kv_heads, int head_dim, int rotary_dim) -> Tensor");
  m.def(
      "decoder_stack(Tensor hidden, Tensor positions, Tensor cos_sin, Tensor(a!)[] kv_caches, "
      "Tensor slots, Tensor[] norms, Tensor[] panels, int[] out_features, Tensor?[] biases, "
      "float[] eps, Tensor? tables, Tensor? rows, Tensor? firsts, Tensor? lens, "
      "Tensor? tile_tables, Tensor? tile_chunks, int num_actual, int num_heads, "
      "int num_kv_heads, int head_dim, int rotary_dim, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(spur_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gate_up_silu", &gate_up_silu);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("panel_rows", &panel_rows);
  m.impl("panels_argmax", &panels_argmax);
  m.impl("small_linear", &small_linear);
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f32_panels", &linear_f32_panels);
  m.impl("linear_bf16_panels", &linear_bf16_panels);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("decoder_stack", &decoder_stack);
}
