#include "server/backend/cpu/cpu_kernels.h"

#include <cpuid.h>

#include "absl/strings/str_cat.h"
#include "math/half.h"

namespace ember {
namespace backend {
namespace {

// --- Scalar reference kernels (any x86-64 CPU).
inline float LoadScalar(int type, const void* row, int64_t i) {
  switch (type) {
    case 1:
      return Fp16ToFloat(static_cast<const uint16_t*>(row)[i]);
    case 2:
      return Bf16ToFloat(static_cast<const uint16_t*>(row)[i]);
    default:
      return static_cast<const float*>(row)[i];
  }
}

template <int T>
void AccScalar(float* acc, const void* row, int64_t dim, float scale) {
  for (int64_t i = 0; i < dim; ++i) acc[i] += scale * LoadScalar(T, row, i);
}

template <int T>
bool PoolScalar(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                const int64_t* ids, const float* weights, int64_t n, int64_t /*ids_avail*/,
                int64_t dim, float out_scale, PrefetchAhead /*prefetch*/) {
  bool bad = false;
  for (int64_t c = 0; c < dim; ++c) out[c] = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    AccScalar<T>(out, table + CheckedId(ids, k, rows, &bad) * row_bytes, dim,
                 weights == nullptr ? 1.0f : weights[k]);
  }
  for (int64_t c = 0; c < dim; ++c) out[c] *= out_scale;
  return !bad;
}

template <int T>
void WidenScalar(float* out, const void* row, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) out[i] = LoadScalar(T, row, i);
}

const RowKernels kScalar = {
    "scalar",
    {AccScalar<0>, AccScalar<1>, AccScalar<2>, AccQuantized<3>, AccQuantized<4>},
    {PoolScalar<0>, PoolScalar<1>, PoolScalar<2>, PoolQuantizedScalar<3>, PoolQuantizedScalar<4>},
    {WidenScalar<0>, WidenScalar<1>, WidenScalar<2>, DequantizeRowOf<3>, DequantizeRowOf<4>},
    {nullptr, NarrowOneByOne<1>, NarrowOneByOne<2>, nullptr, nullptr},
    {nullptr, NarrowNearestOneByOne<1>, NarrowNearestOneByOne<2>, QuantizeRowNearest<3>,
     QuantizeRowNearest<4>}};

// F16C through CPUID (leaf 1, ECX bit 29): clang has no "f16c" feature
// name for __builtin_cpu_supports.
bool HasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}

bool HasAvx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
}
bool HasAvx512() {
  return HasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// The AVX-512 table for this CPU's vendor (cpu_kernel_types.h).
const RowKernels& Avx512RowKernels() {
  return CpuIsIntel() ? kAvx512IntelRowKernels : kAvx512RowKernels;
}

}  // namespace

const RowKernels& BestRowKernels() {
  if (HasAvx512()) return Avx512RowKernels();
  if (HasAvx2()) return kAvx2RowKernels;
  return kScalar;
}

bool CpuIsIntel() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  // The vendor string is EBX, EDX, ECX: "Genu" "ineI" "ntel".
  return ebx == 0x756e6547u && edx == 0x49656e69u && ecx == 0x6c65746eu;
}

absl::StatusOr<const RowKernels*> RowKernelsFor(const std::string& isa) {
  if (isa == "auto" || isa.empty()) return &BestRowKernels();
  if (isa == "scalar") return &kScalar;
  if (isa == "avx2") {
    if (!HasAvx2()) return absl::FailedPreconditionError("this CPU lacks AVX2/FMA/F16C");
    return &kAvx2RowKernels;
  }
  if (isa == "avx512") {
    if (!HasAvx512()) return absl::FailedPreconditionError("this CPU lacks AVX-512 F/BW/DQ/VL");
    return &Avx512RowKernels();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", isa, "' (valid: auto, scalar, avx2, avx512)"));
}

}  // namespace backend
}  // namespace ember
