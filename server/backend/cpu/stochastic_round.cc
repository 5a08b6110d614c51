// StochasticRoundOne, NarrowOneByOne and NarrowNearestOneByOne
// (cpu_kernel_types.h): their own library, built without the wider ISAs,
// which every kernel table links against (the scalar table's narrowing,
// the vector tables' tails).
#include "math/embedding_math.h"
#include "server/backend/cpu/cpu_kernel_types.h"

namespace ember {
namespace backend {

uint16_t StochasticRoundOne(int type, float w, uint64_t row_key, int64_t col) {
  const uint32_t noise = math::ElementNoise(row_key, col);
  return type == 1 ? math::FloatToFp16Stochastic(w, noise) : math::FloatToBf16Stochastic(w, noise);
}

template <int T>
void NarrowOneByOne(void* row, const float* w, int64_t dim, uint64_t row_key, int64_t col_offset) {
  uint16_t* out = static_cast<uint16_t*>(row);
  for (int64_t c = 0; c < dim; ++c) out[c] = StochasticRoundOne(T, w[c], row_key, col_offset + c);
}
template void NarrowOneByOne<1>(void*, const float*, int64_t, uint64_t, int64_t);
template void NarrowOneByOne<2>(void*, const float*, int64_t, uint64_t, int64_t);

template <int T>
void NarrowNearestOneByOne(void* row, const float* w, int64_t dim) {
  uint16_t* out = static_cast<uint16_t*>(row);
  for (int64_t c = 0; c < dim; ++c) out[c] = T == 1 ? FloatToFp16(w[c]) : FloatToBf16(w[c]);
}
template void NarrowNearestOneByOne<1>(void*, const float*, int64_t);
template void NarrowNearestOneByOne<2>(void*, const float*, int64_t);

}  // namespace backend
}  // namespace ember
