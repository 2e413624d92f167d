// RMSNorm, with and without the residual add.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
