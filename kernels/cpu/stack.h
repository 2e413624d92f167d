// decoder_stack: every layer of a Llama decoder in one call.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

// ------------------------------------------------------------------ decoder stack
//
// Every layer of a Llama decoder (models/llama_stack.py) in one call: the ops of the
// parts included before this one, in the order and with the arguments the layers'
// Python would pass them, so the results are theirs bit for bit. Called once a step instead of ~9 ops a layer from Python: no
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
