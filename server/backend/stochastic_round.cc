// StochasticRoundOne (cpu_kernel_types.h): its own library, built without
// the wider ISAs, which both per-ISA kernel libraries link against for the
// lanes their vector paths hand back.
#include "server/backend/cpu_kernel_types.h"
#include "server/backend/embedding_math.h"

namespace ember {
namespace backend {

uint16_t StochasticRoundOne(int type, float w, uint64_t row_key, int64_t col) {
  const uint32_t noise = math::ElementNoise(row_key, col);
  return type == 1 ? math::FloatToFp16Stochastic(w, noise) : math::FloatToBf16Stochastic(w, noise);
}

}  // namespace backend
}  // namespace ember
