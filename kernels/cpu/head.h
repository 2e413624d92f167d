// The LM head's greedy pick (argmax_rows, panels_argmax) and a tied embedding's
// lookup in the head's panels (panel_rows).
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
