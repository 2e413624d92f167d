// Decode attention over the paged cache: the scalar loop, the SIMD path and
// attend_bf16 (bf16 dot products, its line feed), and the decode_attention op.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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
  // The metadata is trusted as offsets below: check it (one pass over the requests).
  const int64_t N = rows.size(0);
  TORCH_CHECK(firsts.size(0) == N && lens.size(0) == N && tables.dim() == 2 &&
                  tables.size(0) == N,
              "decode_attention: rows, firsts, lens and tables must have one entry per request");
  {
    const int32_t *rp = rows.data_ptr<int32_t>(), *fp = firsts.data_ptr<int32_t>(),
                  *lp = lens.data_ptr<int32_t>();
    const int64_t cap = tables.size(1) * k_cache.size(1);
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < q.size(0) && fp[i] >= 0 && fp[i] <= lp[i] &&
                      lp[i] <= cap,
                  "decode_attention: request ", i, " (row ", rp[i], ", positions ", fp[i],
                  " to ", lp[i], ") must be within q's ", q.size(0), " rows and its table's ",
                  cap, " positions");
  }
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  if (N == 0) return;
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

}  // namespace
