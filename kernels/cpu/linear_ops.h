// The linear ops: argument checks and dispatch to the bf16 / float32 kernels.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

// The checks both small-batch linears share: x [M, K] and weight [N, K] of `dtype`
// with unit inner strides, K a multiple of `k_multiple`, 1 to `max_rows` rows, and an
// optional contiguous bias [N] of `dtype`. Returns the bias's data, or nullptr.
const void* check_small_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                               const char* dtype_name, int64_t k_multiple, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, op, ": ", dtype_name,
              " only");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, op, ": unit inner strides");
  TORCH_CHECK(x.size(1) % k_multiple == 0, op, ": K must be a multiple of ", k_multiple);
  TORCH_CHECK(x.size(0) >= 1, op, ": at least one row of x");
  TORCH_CHECK(x.size(0) <= max_rows, op, ": 1 to ", max_rows, " rows");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() &&
                  bias->numel() == weight.size(0),
              op, ": bias [N] ", dtype_name);
  return bias->data_ptr();
}

bool linear_f32_supported() { return kLinearF32; }

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kLinearF32, "linear_f32: built for a CPU without AVX2 + FMA or AVX-512");
  const auto* b = static_cast<const float*>(
      check_small_linear("linear_f32", x, weight, bias, at::kFloat, "float32", 8, INT64_MAX));
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
#ifdef SPUR_SIMD
  (M <= kLinearF32UnitRows ? linear_f32_typed : linear_f32_packed)(
      x.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K,
      x.stride(0), weight.stride(0));
#endif
  return y;
}

int64_t linear_f32_panel_width() {
#ifdef SPUR_SIMD
  return 2 * LinearVec::W;
#else
  return 0;
#endif
}

// The checks of the float32 panel kernels (linear_f32_panels, gate_up_silu,
// panels_argmax): x [M, K] float32, M >= 1, with a unit inner stride, panels
// [ceil(n / PW), K, PW] in native.pack_linear_f32's layout, and an optional contiguous
// bias [n] float32. Returns the bias's data, or nullptr.
const float* check_f32_panels(const char* op, const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t PW = linear_f32_panel_width();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(0) >= 1,
              op, ": x [M, K] float32 with a unit inner stride");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == PW &&
                  panels.size(0) == (n + PW - 1) / PW,
              op, ": x [M, K] and panels [ceil(n / ", PW, "), K, ", PW,
              "] float32, contiguous (native.pack_linear_f32's layout)");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": bias [n] float32");
  return bias->data_ptr<float>();
}

at::Tensor linear_f32_panels(const at::Tensor& x, const at::Tensor& panels,
                             const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(kLinearF32, "linear_f32_panels: built for a CPU without AVX2 + FMA or AVX-512");
  const float* b = check_f32_panels("linear_f32_panels", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
#ifdef SPUR_SIMD
  linear_f32_panels_typed(x.data_ptr<float>(), panels.data_ptr<float>(), b, y.data_ptr<float>(), M,
                          n, K, x.stride(0));
#endif
  return y;
}

bool small_linear_supported() { return kSmallLinear; }

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kSmallLinear, "small_linear: built without AVX-512 BF16");
  const auto* b = static_cast<const bf16*>(
      check_small_linear("small_linear", x, weight, bias, at::kBFloat16, "bfloat16", 32,
                         kSmallLinearMaxRows));
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t xr = x.stride(0), wr = weight.stride(0);
  // 1 to 4 rows: one chunk, 16 / M weight rows a unit; more: chunks of 6 rows, 4 a unit
  switch (M) {
    case 1: small_linear_typed<1, 16>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 2: small_linear_typed<2, 8>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 3: small_linear_typed<3, 5>(xp, wp, b, yp, M, N, K, xr, wr); break;
    case 4: small_linear_typed<4, 4>(xp, wp, b, yp, M, N, K, xr, wr); break;
    default: small_linear_typed<6, 4>(xp, wp, b, yp, M, N, K, xr, wr); break;
  }
#endif
  return y;
}

// The checks of the bf16 panel kernels (linear_bf16_panels, gate_up_silu,
// panels_argmax): x [M, K] bfloat16, M >= 1, with a unit inner stride and an even K,
// panels [ceil(n / 32), K / 2, 32, 2] in native.pack_linear_bf16's layout, and an
// optional contiguous bias [n] bfloat16. Returns the bias's data, or nullptr.
const bf16* check_bf16_panels(const char* op, const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(0) >= 1 && x.size(1) % 2 == 0,
              op, ": x [M, K] bfloat16 with a unit inner stride and an even K");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous() && panels.size(0) == (n + 31) / 32 &&
                  panels.size(1) == x.size(1) / 2 && panels.size(2) == 32 && panels.size(3) == 2,
              op, ": x [M, K] and panels [ceil(n / 32), K / 2, 32, 2] bfloat16, contiguous "
              "(native.pack_linear_bf16's layout)");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
              op, ": bias [n] bfloat16");
  return bias->data_ptr<bf16>();
}

at::Tensor linear_bf16_panels(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t n,
                              bool float_out = false) {
  TORCH_CHECK(kSmallLinear, "linear_bf16_panels: built without AVX-512 BF16");
  const bf16* b = check_bf16_panels("linear_bf16_panels", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  if (float_out)
    linear_bf16_panels_typed(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<float>(),
                             M, n, K, x.stride(0));
  else
    linear_bf16_panels_typed(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<bf16>(),
                             M, n, K, x.stride(0));
#endif
  return y;
}

// Whether this build's gate_up_silu takes `panels` (bf16: [P, K / 2, 32, 2]; float32:
// [P, K, PW]) of n gate and up features: n / 2 must be a whole number of panels, so
// that no panel mixes gate and up columns.
bool gate_up_silu_fits(const at::Tensor& panels, int64_t n) {
  if (panels.dim() == 4) return kSmallLinear && n > 0 && n % 64 == 0;
  return kLinearF32 && n > 0 && n % (2 * linear_f32_panel_width()) == 0;
}

// gate_up_silu(x [M, K], panels, bias [n]?, n) -> silu_and_mul(linear_*_panels(x,
// panels, bias, n)) [M, n / 2] (gate_up_silu_bf16, gate_up_silu_f32).
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t n) {
  const bool bf = panels.dim() == 4;
  TORCH_CHECK(bf ? kSmallLinear : kLinearF32, "gate_up_silu: this build has no ",
              bf ? "bf16" : "float32", " panels (use the linear and silu_and_mul)");
  TORCH_CHECK(gate_up_silu_fits(panels, n), "gate_up_silu: n (gate and up features) must be a "
              "multiple of 2 x the panel width (", bf ? 32 : linear_f32_panel_width(),
              "); otherwise use the linear and silu_and_mul");
  if (bf) {
    const bf16* b = check_bf16_panels("gate_up_silu", x, panels, bias, n);
    const int64_t M = x.size(0), K = x.size(1);
    auto y = at::empty({M, n / 2}, x.options());
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
    gate_up_silu_bf16(x.data_ptr<bf16>(), panels.data_ptr<bf16>(), b, y.data_ptr<bf16>(), M,
                      n / 2, K, x.stride(0));
#endif
    return y;
  }
  const float* b = check_f32_panels("gate_up_silu", x, panels, bias, n);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n / 2}, x.options());
#ifdef SPUR_SIMD
  gate_up_silu_f32(x.data_ptr<float>(), panels.data_ptr<float>(), b, y.data_ptr<float>(), M,
                   n / 2, K, x.stride(0));
#endif
  return y;
}

}  // namespace
