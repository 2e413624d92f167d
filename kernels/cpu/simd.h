// Vector helpers: Vec512 / Vec256 (lanes, loads, the transpose-and-add of W dot
// products), bf16 <-> float vectors and exp16, for AVX-512 and AVX2 + FMA builds.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
