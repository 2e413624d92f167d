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

// The ops, one file a family under kernels/cpu/, all in this one translation unit, so
// that they inline into each other as they would in one file. In dependency order.
#include "cpu/common.h"
#include "cpu/simd.h"
#include "cpu/decode_attention.h"
#include "cpu/prefill_attention.h"
#include "cpu/norm.h"
#include "cpu/activation.h"
#include "cpu/rope.h"
#include "cpu/linear_bf16.h"
#include "cpu/linear_f32.h"
#include "cpu/linear_ops.h"
#include "cpu/head.h"
#include "cpu/stack.h"

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
