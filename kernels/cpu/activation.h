// SiLU-and-mul, and the pair loop of the fused gate_up + SiLU ops.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
