// RoPE of q and k, fused with the K/V store.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

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

}  // namespace
