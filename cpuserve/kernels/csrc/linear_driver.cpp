#include "linear_driver.h"

#include <vector>

#include "panel_layout.h"

namespace cpk {
namespace {

// One matmul's quantized activations, in buffers kept per calling thread and reused: a decode step
// makes ~120 matmuls, and four allocations each showed in its profile. Rows are readable 4 bytes past
// the last (the int8 panel kernels read whole quads; the padded weights are zero there).
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

Activations& scratch(int64_t m, int64_t k, int64_t groups) {
  thread_local Activations act;
  act.q.resize(m * k + 4);
  act.scales.resize(m);
  act.sums.resize(m * groups);
  return act;
}

// A row as fp32: itself, or widened into buf (no fp32 copy of the whole input).
inline const float* widen(const float* row, int64_t, std::vector<float>&) { return row; }
template <typename T>
const float* widen(const T* row, int64_t k, std::vector<float>& buf) {
  buf.resize(k);
  for (int64_t i = 0; i < k; ++i) buf[i] = to_float(row[i]);
  return buf.data();
}

template <typename T>
void quantize_rows_of(const Variant& v, const Parallel& par, const T* x, int64_t m, int64_t k, int64_t group,
                      Activations& act, bool with_sums) {
  const int64_t groups = group > 0 ? k / group : 0;
  par.for_range(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;
    for (int64_t r = begin; r < end; ++r)
      v.quantize_row(widen(x + r * k, k, wide), k, group, act.q.data() + r * k, act.scales.data() + r,
                     with_sums ? act.sums.data() + r * groups : nullptr);
  });
}

// Per-token quantization of x, rows shared out; group sums when group > 0.
void quantize_rows(const Variant& v, const Parallel& par, const LinearInput& in, int64_t group, Activations& act) {
  count(v, kQuantize);
  const bool sums = group > 0;
  if (in.dtype == DType::F32) return quantize_rows_of(v, par, static_cast<const float*>(in.x), in.m, in.k, group, act, sums);
  if (in.dtype == DType::Bf16) return quantize_rows_of(v, par, static_cast<const Bf16*>(in.x), in.m, in.k, group, act, sums);
  quantize_rows_of(v, par, static_cast<const F16*>(in.x), in.m, in.k, group, act, sums);
}

// Output work shared out: panels for a panel layout, else columns.
void over_outputs(const Parallel& par, bool panels, int64_t n, LinearKernel kernel, const LinearArgs& args) {
  auto body = [&](int64_t begin, int64_t end) { kernel(args, begin, end); };
  if (panels)
    par.for_range(0, panel_count(n), 1, body);
  else
    par.for_range(0, n, 16, body);
}

}  // namespace

void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t n, float* out) {
  count(v, kW8A8);
  const bool offset = v.int8 == Int8Layout::OffsetPanels;  // uint8 w + 128: one activation sum per row corrects it
  Activations& act = scratch(in.m, in.k, 1);
  quantize_rows(v, par, in, offset ? in.k : 0, act);
  const LinearArgs args{act.q.data(), act.scales.data(), act.sums.data(), in.m, in.k, w, scales, 1, n, out};
  over_outputs(par, is_panels(v.int8), n, v.w8a8, args);
}

void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out) {
  count(v, kW4A8);
  Activations& act = scratch(in.m, in.k, groups);
  quantize_rows(v, par, in, in.k / groups, act);
  const LinearArgs args{act.q.data(), act.scales.data(), act.sums.data(), in.m, in.k, w, scales, groups, n, out};
  over_outputs(par, is_panels(v.int4), n, v.w4a8, args);
}

void decode_attention(const Variant& v, const Parallel& par, const AttentionArgs& a) {
  count(v, kDecodeAttention);
  v.decode_attention(a, par);
}

}  // namespace cpk
