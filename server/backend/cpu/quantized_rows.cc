// The row-wise quantized rows' scalar functions (cpu_kernel_types.h): their
// own translation unit, built without the wider ISAs and with no fused
// multiply-add, which every kernel table links against.
#include "math/rowwise_quant.h"
#include "server/backend/cpu/cpu_kernel_types.h"

namespace ember {
namespace backend {
namespace {
constexpr int BitsOf(int type) { return type == 4 ? 4 : 8; }
}  // namespace

template <int T>
void QuantizeRowNearest(void* row, const float* w, int64_t dim) {
  math::QuantizeRowKeeping(BitsOf(T), w, dim, static_cast<uint8_t*>(row));
}

template <int T>
void DequantizeRowOf(float* out, const void* row, int64_t dim) {
  math::DequantizeRow(BitsOf(T), static_cast<const uint8_t*>(row), dim, out);
}

template <int T>
void AccQuantized(float* acc, const void* row, int64_t dim, float scale) {
  const uint8_t* r = static_cast<const uint8_t*>(row);
  float s, b;
  math::QuantScaleBias(r, &s, &b);
  const float ws = scale * s, wb = scale * b;
  for (int64_t c = 0; c < dim; ++c) {
    acc[c] += ws * static_cast<float>(math::QuantValue(BitsOf(T), r, c)) + wb;
  }
}

template <int T>
bool PoolQuantizedScalar(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                         const int64_t* ids, const float* weights, int64_t n,
                         int64_t /*ids_avail*/, int64_t dim, float out_scale,
                         PrefetchAhead /*prefetch*/) {
  bool bad = false;
  float bias_sum = 0.0f;
  for (int64_t c = 0; c < dim; ++c) out[c] = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t* r = table + CheckedId(ids, k, rows, &bad) * row_bytes;
    float s, b;
    math::QuantScaleBias(r, &s, &b);
    const float w = weights == nullptr ? 1.0f : weights[k];
    const float ws = w * s;
    bias_sum += w * b;
    for (int64_t c = 0; c < dim; ++c) {
      out[c] += ws * static_cast<float>(math::QuantValue(BitsOf(T), r, c));
    }
  }
  for (int64_t c = 0; c < dim; ++c) out[c] = (out[c] + bias_sum) * out_scale;
  return !bad;
}

template void QuantizeRowNearest<3>(void*, const float*, int64_t);
template void QuantizeRowNearest<4>(void*, const float*, int64_t);
template void DequantizeRowOf<3>(float*, const void*, int64_t);
template void DequantizeRowOf<4>(float*, const void*, int64_t);
template void AccQuantized<3>(float*, const void*, int64_t, float);
template void AccQuantized<4>(float*, const void*, int64_t, float);
template bool PoolQuantizedScalar<3>(float*, const uint8_t*, int64_t, uint64_t, const int64_t*,
                                     const float*, int64_t, int64_t, int64_t, float,
                                     PrefetchAhead);
template bool PoolQuantizedScalar<4>(float*, const uint8_t*, int64_t, uint64_t, const int64_t*,
                                     const float*, int64_t, int64_t, int64_t, float,
                                     PrefetchAhead);

}  // namespace backend
}  // namespace ember
