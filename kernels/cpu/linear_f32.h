// float32 linears: the small-batch kernel and the packed panels' tiles.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
