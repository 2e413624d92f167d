// bf16 linears: the small-batch kernel and the packed panels' tiles.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
