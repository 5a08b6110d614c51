// The CUDA backend's kernels, written once against a warp (warp.h): under
// nvcc the __global__ kernels in tbe_kernels.cu call these with DeviceWarp;
// in host builds the emulated backend (emulated_backend.h) calls the same
// code with HostWarp, so the parity suite runs these algorithms on any CPU.
// Only the CUDA runtime calls, CUB's sort and scans, and the intrinsics
// behind Load4/Store4 and the shuffles stay device-only.
//
// Warp bodies (names end in Warp) take the warp, its index among all warps
// and the warp count, and loop grid-stride as a kernel's warps do; thread
// bodies (names end in One) handle one index.
#ifndef EMBER_CUDA_KERNEL_BODIES_H_
#define EMBER_CUDA_KERNEL_BODIES_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "cuda/kernel_descs.h"
#include "cuda/warp.h"
#include "math/embedding_math.h"
#include "math/half.h"
#include "math/key_index.h"

namespace ember {
namespace cuda {
namespace kernels {

namespace math = backend::math;

// A keyed lookup's id `e` replaced by its slot in a dynamic shard's key
// index (math/key_index.h's probe, as DynamicIndex::Find), or `missing`.
// One thread a key: an id's home line is 64 bytes, two 32-byte sectors
// read once; at the index's load (at most half full) about 4% of keys
// probe on into the next line.
EMBER_KERNEL void KeyFindOne(int64_t e, int64_t* ids, const math::KeyLine* lines, uint64_t mask,
                             int64_t missing) {
  ids[e] = math::KeyProbe(lines, mask, ids[e], missing);
}

// Word e of a copy of rows between a packed buffer and a shard's rows at
// `rows` (distinct), `words` 4-byte words a row: gather (shard -> packed)
// or scatter (packed -> shard). For ExportRowsAt / ImportRowsAt.
EMBER_KERNEL void CopyRowWordOne(int64_t e, const int64_t* rows, int64_t words,
                                 const uint32_t* from, uint32_t* to, bool gather) {
  const int64_t k = e / words, j = e % words;
  if (gather) {
    to[e] = from[rows[k] * words + j];
  } else {
    to[rows[k] * words + j] = from[e];
  }
}

// Integer codes of the enums (backend::WeightType, backend::Pooling).
constexpr int32_t kFp16 = 1;
constexpr int32_t kBf16 = 2;
constexpr int32_t kMean = 1;
constexpr int32_t kNone = 2;

// Hot rows: a run of more than kHotRun occurrences of one row is summed in
// chunks of kHotRun by separate warps (PartialSumWarp), then added by the
// row's update warp (FBGEMM splits long segments the same way).
constexpr int64_t kHotRun = 32;

// A float's bits (for the atomics on its magnitude).
EMBER_KERNEL unsigned int FloatBitsOf(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  unsigned int u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

struct alignas(16) Vec4 {
  float x, y, z, w;
};

// Storage tags: what a table's elements are.
struct Fp32 {
  using Storage = float;
};
struct Fp16 {
  using Storage = uint16_t;
};
struct Bf16 {
  using Storage = uint16_t;
};

// Four consecutive elements as fp32. p is 16-byte (fp32) or 8-byte aligned:
// dim is a multiple of 4 and buffers are cudaMalloc'd (or 64-byte aligned on
// the host).
EMBER_KERNEL Vec4 Load4(Fp32, const float* p) {
#ifdef __CUDA_ARCH__
  const float4 v = *reinterpret_cast<const float4*>(p);
  return {v.x, v.y, v.z, v.w};
#else
  return {p[0], p[1], p[2], p[3]};
#endif
}
EMBER_KERNEL Vec4 Load4(Fp16, const uint16_t* p) {
#ifdef __CUDA_ARCH__
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  return {__half2float(__ushort_as_half(static_cast<unsigned short>(raw.x & 0xffffu))),
          __half2float(__ushort_as_half(static_cast<unsigned short>(raw.x >> 16))),
          __half2float(__ushort_as_half(static_cast<unsigned short>(raw.y & 0xffffu))),
          __half2float(__ushort_as_half(static_cast<unsigned short>(raw.y >> 16)))};
#else
  return {backend::Fp16ToFloat(p[0]), backend::Fp16ToFloat(p[1]), backend::Fp16ToFloat(p[2]),
          backend::Fp16ToFloat(p[3])};
#endif
}
EMBER_KERNEL Vec4 Load4(Bf16, const uint16_t* p) {
  // Exact: bf16 bits are the top half of the fp32 bits.
#ifdef __CUDA_ARCH__
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  return {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
          __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u)};
#else
  return {backend::Bf16ToFloat(p[0]), backend::Bf16ToFloat(p[1]), backend::Bf16ToFloat(p[2]),
          backend::Bf16ToFloat(p[3])};
#endif
}

// Stores four fp32 values, rounded to nearest even for fp16 / bf16 (the
// hardware conversions on the device, half.h's on the host: the same bits).
EMBER_KERNEL void Store4(Fp32, float* p, Vec4 v) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<float4*>(p) = make_float4(v.x, v.y, v.z, v.w);
#else
  p[0] = v.x;
  p[1] = v.y;
  p[2] = v.z;
  p[3] = v.w;
#endif
}
EMBER_KERNEL void StorePacked4(uint16_t* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#ifdef __CUDA_ARCH__
  uint2 raw;
  raw.x = a | (b << 16);
  raw.y = c | (d << 16);
  *reinterpret_cast<uint2*>(p) = raw;
#else
  p[0] = static_cast<uint16_t>(a);
  p[1] = static_cast<uint16_t>(b);
  p[2] = static_cast<uint16_t>(c);
  p[3] = static_cast<uint16_t>(d);
#endif
}
EMBER_KERNEL uint32_t ToFp16(float x) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(x));
#else
  return backend::FloatToFp16(x);
#endif
}
EMBER_KERNEL uint32_t ToBf16(float x) {
#ifdef __CUDA_ARCH__
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  return backend::FloatToBf16(x);
#endif
}
EMBER_KERNEL void Store4(Fp16, uint16_t* p, Vec4 v) {
  StorePacked4(p, ToFp16(v.x), ToFp16(v.y), ToFp16(v.z), ToFp16(v.w));
}
EMBER_KERNEL void Store4(Bf16, uint16_t* p, Vec4 v) {
  StorePacked4(p, ToBf16(v.x), ToBf16(v.y), ToBf16(v.z), ToBf16(v.w));
}

// First index i in [0, n) with a[i] > x, or n.
template <typename T>
EMBER_KERNEL int64_t UpperBound(const T* a, int64_t n, T x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Whether `x` is NaN or Inf.
EMBER_KERNEL bool NonFinite(float x) {
#ifdef __CUDA_ARCH__
  return !isfinite(x);
#else
  return !std::isfinite(x);
#endif
}

// Whether element e of a call's device inputs (InputCheckDesc's numbering)
// is bad: an id outside [0, rows), a NaN or Inf weight or gradient float.
// begin[r] is descs[r].begin, begin[n] the element count (for the search).
// Its |value| as float bits goes to max_bits[0] (a gradient float) or
// max_bits[1] (a weight), when larger.
EMBER_KERNEL bool BadInputOne(int64_t e, const int64_t* begin, const InputCheckDesc* descs,
                              int64_t n, unsigned int* max_bits) {
  const InputCheckDesc& d = descs[UpperBound(begin, n + 1, e) - 1];
  int64_t k = e - d.begin;
  unsigned int bits;
  if (k < d.num_weights) {
    bits = FloatBitsOf(d.weights[k]) & 0x7fffffffu;
    if (bits > max_bits[1]) max_bits[1] = bits;
    return NonFinite(d.weights[k]);
  }
  k -= d.num_weights;
  if (k < d.num_ids) return d.ids[k] < 0 || d.ids[k] >= d.rows;
  const float g = d.grad[k - d.num_ids];
  bits = FloatBitsOf(g) & 0x7fffffffu;
  if (bits > max_bits[0]) max_bits[0] = bits;
  return NonFinite(g);
}

// Element e of a shard's measurement (MeasureLaunch): weights first, then
// the state; its contribution goes to local[0..2] (the caller's maxima).
template <typename MeasureArgs>
EMBER_KERNEL void MeasureOne(int64_t e, const MeasureArgs& a, unsigned int* local) {
  const int64_t n = a.rows * a.dim;
  if (e < n) {
    float w;
    if (a.weight_type == kFp16) {
      w = backend::Fp16ToFloat(static_cast<const uint16_t*>(a.weights)[e]);
    } else if (a.weight_type == kBf16) {
      w = backend::Bf16ToFloat(static_cast<const uint16_t*>(a.weights)[e]);
    } else {
      w = static_cast<const float*>(a.weights)[e];
    }
    const unsigned int bits = FloatBitsOf(w) & 0x7fffffffu;
    if (bits > local[0]) local[0] = bits;
    return;
  }
  const int64_t k = e - n;
  const int64_t c = k % a.state_width;
  const float x = a.state[k];
  if (c >= a.first_acc) {
    // Accumulators are >= 0 (imports refuse others); NaN's bits exceed all.
    const unsigned int bits = FloatBitsOf(x) & 0x7fffffffu;
    if (bits > local[1]) local[1] = bits;
  }
  if (a.adam && c < a.dim) {
    const float v = a.state[k + a.dim];
    if (!(fabsf(x) <= a.adam_c * sqrtf(v > 0 ? v : 0.0f))) local[2] = 1;
  }
}

// How a warp covers a row of `dim` elements: chunks of 4 elements, `group`
// lanes per row (a power of two, <= 32), so 32 / group rows are read at
// once. Lane = sub * group + chunk_lane. All fields are warp-uniform except
// sub and chunk_lane.
struct WarpGeometry {
  int64_t chunks;
  int group;
  int rows_at_once;
  int sub;
  int chunk_lane;
};

EMBER_KERNEL WarpGeometry MakeGeometry(int64_t dim, int lane) {
  WarpGeometry g;
  g.chunks = dim / 4;
  const int c = static_cast<int>(g.chunks < kWarpSize ? g.chunks : kWarpSize);
  g.group = 1;
  while (g.group < c) g.group <<= 1;  // next power of two >= c
  g.rows_at_once = kWarpSize / g.group;
  g.sub = lane / g.group;
  g.chunk_lane = lane % g.group;
  return g;
}

// Sum over k in [b, e) of scale_k * row_k[col .. col + 3], where meta(k,
// &offset, &scale) gives row_k = base + offset. Must be called by the whole
// warp with warp-uniform b, e and geometry; `active` says whether this
// lane's column exists. Every lane gets the total of its chunk_lane.
template <typename Tag, typename Warp, typename Meta>
EMBER_KERNEL Vec4 WarpGather(Warp& w, const typename Tag::Storage* base, int64_t b, int64_t e,
                             int64_t col, bool active, const WarpGeometry& g, Meta meta) {
  const int lane = w.lane();
  Vec4 acc = {0.f, 0.f, 0.f, 0.f};
  for (int64_t k0 = b; k0 < e; k0 += kWarpSize) {
    const int n = static_cast<int>(e - k0 < kWarpSize ? e - k0 : kWarpSize);
    int64_t my_off = 0;
    float my_scale = 0.f;
    if (lane < n) meta(k0 + lane, &my_off, &my_scale);
    for (int j0 = 0; j0 < n; j0 += g.rows_at_once) {
      // j0 <= 32 - rows_at_once, so j stays a valid lane.
      const int j = j0 + g.sub;
      const int64_t off = w.shfl(my_off, j);
      const float s = w.shfl(my_scale, j);
      if (j < n && active) {
        const Vec4 x = Load4(Tag(), base + off + col);
        acc.x = fmaf(s, x.x, acc.x);
        acc.y = fmaf(s, x.y, acc.y);
        acc.z = fmaf(s, x.z, acc.z);
        acc.w = fmaf(s, x.w, acc.w);
      }
    }
  }
  for (int m = g.group; m < kWarpSize; m <<= 1) {
    acc.x += w.shfl_xor(acc.x, m);
    acc.y += w.shfl_xor(acc.y, m);
    acc.z += w.shfl_xor(acc.z, m);
    acc.w += w.shfl_xor(acc.w, m);
  }
  return acc;
}

// ---------------------------------------------------------------------------
// Forward.

// out[0, dim) = scale * sum over ids[k], k in [b, e), of weight_k * row.
template <typename Tag, typename Warp>
EMBER_KERNEL void PoolItem(Warp& w, const typename Tag::Storage* table, int64_t dim,
                           const int64_t* ids, const float* weights, int64_t b, int64_t e,
                           float scale, float* out) {
  const WarpGeometry g = MakeGeometry(dim, w.lane());
  auto meta = [ids, weights, dim](int64_t k, int64_t* off, float* s) {
    *off = ids[k] * dim;
    *s = weights != nullptr ? weights[k] : 1.0f;
  };
  for (int64_t cb = 0; cb < g.chunks; cb += g.group) {
    const int64_t c = cb + g.chunk_lane;
    const bool active = c < g.chunks;
    Vec4 acc = WarpGather<Tag>(w, table, b, e, 4 * c, active, g, meta);
    if (active && g.sub == 0) {
      acc.x *= scale;
      acc.y *= scale;
      acc.z *= scale;
      acc.w *= scale;
      Store4(Fp32(), out + 4 * c, acc);
    }
  }
}

// Every work item (a bag of a pooled feature, an id of a NONE feature) of
// every request. offsets[0, total_bags] is the exclusive scan of the
// concatenated lengths.
template <typename Warp>
EMBER_KERNEL void LookupWarp(Warp& w, int64_t warp, int64_t warps, const int64_t* item_begin,
                             const LookupDesc* descs, int64_t num_requests,
                             const int64_t* offsets, const int64_t* ids, const float* weights,
                             float* out) {
  const int64_t total_items = item_begin[num_requests];
  for (int64_t item = warp; item < total_items; item += warps) {
    const int64_t r = UpperBound(item_begin, num_requests + 1, item) - 1;
    const LookupDesc d = descs[r];
    const int64_t local = item - item_begin[r];
    int64_t b, e;
    float scale = 1.0f;
    if (d.pooling == kNone) {
      b = d.id_begin + local;
      e = b + 1;
    } else {
      b = offsets[d.bag_begin + local];
      e = offsets[d.bag_begin + local + 1];
      if (d.pooling == kMean) scale = math::MeanScale(e - b);  // an empty bag stays 0
    }
    const float* wt = d.weighted ? weights : nullptr;
    float* o = out + d.out_begin + local * d.dim;
    switch (d.weight_type) {
      case kFp16:
        PoolItem<Fp16>(w, static_cast<const uint16_t*>(d.weights), d.dim, ids, wt, b, e, scale, o);
        break;
      case kBf16:
        PoolItem<Bf16>(w, static_cast<const uint16_t*>(d.weights), d.dim, ids, wt, b, e, scale, o);
        break;
      default:
        PoolItem<Fp32>(w, static_cast<const float*>(d.weights), d.dim, ids, wt, b, e, scale, o);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward.

// Id position p: its sort key, p itself, where its gradient row starts in the
// concatenated gradients, and the factor on that row (embedding_math.h).
EMBER_KERNEL void ExpandOne(int64_t p, const int64_t* id_begin, const GradDesc* descs,
                            int64_t num_requests, const int64_t* offsets, const int64_t* ids,
                            const float* weights, uint64_t* keys, int64_t* positions,
                            int64_t* src_off, float* scale) {
  const int64_t r = UpperBound(id_begin, num_requests + 1, p) - 1;
  const GradDesc d = descs[r];
  keys[p] = d.key_base + static_cast<uint64_t>(ids[p]);
  positions[p] = p;
  if (d.pooling == kNone) {
    src_off[p] = d.grad_begin + (p - id_begin[r]) * d.dim;
    scale[p] = 1.0f;
    return;
  }
  // The last bag starting at or before p holds it (empty bags share their
  // start with the next bag, so upper bound skips them).
  const int64_t* bag_start = offsets + d.bag_begin;
  const int64_t bag = UpperBound(bag_start, d.num_bags, p) - 1;
  const float mean =
      d.pooling == kMean ? math::MeanScale(bag_start[bag + 1] - bag_start[bag]) : 1.0f;
  src_off[p] = d.grad_begin + bag * d.dim;
  scale[p] = math::IdScale(d.weighted != 0, d.weighted ? weights[p] : 1.0f, mean);
}

// flags[k] = 1 where sorted key k starts a run, else 0.
EMBER_KERNEL void HeadFlagOne(int64_t k, const uint64_t* keys, int64_t* flags) {
  flags[k] = (k == 0 || keys[k] != keys[k - 1]) ? 1 : 0;
}

// run_id = inclusive scan of the head flags (1-based run of each element);
// run_begin[u] = first element of run u, run_begin[num_runs] = n.
EMBER_KERNEL void RunBeginOne(int64_t k, const int64_t* run_id, int64_t n, int64_t* run_begin) {
  if (k == 0 || run_id[k] != run_id[k - 1]) run_begin[run_id[k] - 1] = k;
  if (k == n - 1) run_begin[run_id[k]] = n;
}

// hot_units[u] = the kHotRun chunks of run u when it is longer than that,
// else 0 (for u < num_runs).
EMBER_KERNEL void HotUnitsOne(int64_t u, const int64_t* run_begin, int64_t* hot_units) {
  const int64_t len = run_begin[u + 1] - run_begin[u];
  hot_units[u] = len > kHotRun ? (len + kHotRun - 1) / kHotRun : 0;
}

// The run a hot chunk belongs to and its occurrences [b, e). hot_end is the
// inclusive scan of hot_units.
EMBER_KERNEL void HotChunk(const int64_t* hot_end, int64_t num_runs, const int64_t* run_begin,
                           int64_t unit, int64_t* run, int64_t* b, int64_t* e) {
  *run = UpperBound(hot_end, num_runs, unit);
  const int64_t first_unit = *run == 0 ? 0 : hot_end[*run - 1];
  *b = run_begin[*run] + (unit - first_unit) * kHotRun;
  const int64_t end = *b + kHotRun;
  *e = end < run_begin[*run + 1] ? end : run_begin[*run + 1];
}

// What the update kernels read: the sorted occurrences, the runs, the shards.
struct UpdateArgs {
  const uint64_t* sorted_keys;
  const int64_t* sorted_positions;
  const int64_t* run_begin;
  const int64_t* num_runs;  // on the device: run_id's last element
  const int64_t* hot_end;
  const uint64_t* key_base;
  const UpdateDesc* shards;
  int64_t num_shards;
  const int64_t* src_off;
  const float* scale;
  const float* grads;
  float* partials;  // [hot chunks, partial_stride]
  int64_t partial_stride;
  int32_t mode;           // UpdateMode
  int32_t guarded_apply;  // kApplyRows: guarded shards' misfit rows are left alone
  int32_t guard_all;      // every shard is guarded, whatever its UpdateDesc::guard
  int32_t unused;
  OverflowRecord* record;  // kCheckRows, kReportRow, guarded kApplyRows
};

// Each hot chunk's scaled gradient rows summed into partials[unit].
template <typename Warp>
EMBER_KERNEL void PartialSumWarp(Warp& w, int64_t warp, int64_t warps, const UpdateArgs& a) {
  const int64_t num_runs = *a.num_runs;
  const int64_t num_units = num_runs == 0 ? 0 : a.hot_end[num_runs - 1];
  const int64_t* positions = a.sorted_positions;
  const int64_t* src_off = a.src_off;
  const float* scale = a.scale;
  auto meta = [positions, src_off, scale](int64_t k, int64_t* off, float* s) {
    const int64_t q = positions[k];
    *off = src_off[q];
    *s = scale[q];
  };
  for (int64_t unit = warp; unit < num_units; unit += warps) {
    int64_t run, b, e;
    HotChunk(a.hot_end, num_runs, a.run_begin, unit, &run, &b, &e);
    const int64_t s = UpperBound(a.key_base, a.num_shards + 1, a.sorted_keys[b]) - 1;
    const WarpGeometry g = MakeGeometry(a.shards[s].dim, w.lane());
    float* out = a.partials + unit * a.partial_stride;
    for (int64_t cb = 0; cb < g.chunks; cb += g.group) {
      const int64_t c = cb + g.chunk_lane;
      const bool active = c < g.chunks;
      const Vec4 v = WarpGather<Fp32>(w, a.grads, b, e, 4 * c, active, g, meta);
      if (active && g.sub == 0) Store4(Fp32(), out + 4 * c, v);
    }
  }
}

EMBER_KERNEL uint32_t StochasticBits(const UpdateDesc& d, float x, uint64_t key, int64_t col) {
  const uint32_t noise = math::ElementNoise(key, d.col_offset + col);
  return d.weight_type == kFp16 ? math::FloatToFp16Stochastic(x, noise)
                                : math::FloatToBf16Stochastic(x, noise);
}

// Stores four updated weights: fp32 as they are, fp16 / bf16 rounded
// stochastically (embedding_math.h) when the shard asks for it, else to
// nearest even.
template <typename Tag>
EMBER_KERNEL void StoreUpdated(const UpdateDesc& d, typename Tag::Storage* p, Vec4 v,
                               uint64_t key, int64_t col) {
  if (d.weight_type == 0 || !d.stochastic) return Store4(Tag(), p, v);
  StorePacked4(reinterpret_cast<uint16_t*>(p), StochasticBits(d, v.x, key, col),
               StochasticBits(d, v.y, key, col + 1), StochasticBits(d, v.z, key, col + 2),
               StochasticBits(d, v.w, key, col + 3));
}

EMBER_KERNEL Vec4 L2Gradient4(const math::StepParams& p, Vec4 g, Vec4 w) {
  return {math::L2Gradient(p, g.x, w.x), math::L2Gradient(p, g.y, w.y),
          math::L2Gradient(p, g.z, w.z), math::L2Gradient(p, g.w, w.w)};
}

// Atomics of the update's record: device atomics under nvcc; on the host,
// where one warp runs at a time and its lanes switch only at shuffles,
// plain reads and writes.
EMBER_KERNEL void AtomicMinU64(unsigned long long* p, unsigned long long v) {  // NOLINT
#ifdef __CUDA_ARCH__
  atomicMin(p, v);
#else
  if (v < *p) *p = v;
#endif
}
EMBER_KERNEL void AtomicMaxU32(unsigned int* p, unsigned int v) {
#ifdef __CUDA_ARCH__
  atomicMax(p, v);
#else
  if (v > *p) *p = v;
#endif
}
EMBER_KERNEL void AtomicAddU64(unsigned long long* p, unsigned long long v) {  // NOLINT
#ifdef __CUDA_ARCH__
  atomicAdd(p, v);
#else
  *p += v;
#endif
}

// A row's update computed and not stored (UpdateRow<kDry>): whether every
// weight fits its type and every state element is finite, the first that
// does not (element number: weights [0, dim), then state dim + k) and its
// value, and the largest |weight| and accumulator. Warp-uniform.
struct RowFit {
  bool fits;
  int64_t bad;
  float value;
  float max_weight;
  float max_acc;
};

// One lane's note of its elements of a dry run.
struct FitNote {
  int64_t bad = INT64_MAX;
  float value = 0;
  float max_weight = 0;
  float max_acc = 0;

  EMBER_KERNEL void Weight(float x, float limit, int64_t e) {
    if (!math::Fits(x, limit)) {
      if (e < bad) bad = e, value = x;
    } else {
      max_weight = fmaxf(max_weight, fabsf(x));
    }
  }
  EMBER_KERNEL void State(float x, int64_t e, bool accumulator) {
    if (!math::Fits(x, math::kStateLimit)) {
      if (e < bad) bad = e, value = x;
    } else if (accumulator) {
      max_acc = fmaxf(max_acc, x);
    }
  }
  EMBER_KERNEL void Weights(Vec4 v, float limit, int64_t e) {
    Weight(v.x, limit, e);
    Weight(v.y, limit, e + 1);
    Weight(v.z, limit, e + 2);
    Weight(v.w, limit, e + 3);
  }
  EMBER_KERNEL void States(Vec4 v, int64_t e, bool accumulator) {
    State(v.x, e, accumulator);
    State(v.y, e + 1, accumulator);
    State(v.z, e + 2, accumulator);
    State(v.w, e + 3, accumulator);
  }
  // The warp's: the smallest bad element (its value from the one lane that
  // holds it) and the largest values.
  template <typename Warp>
  EMBER_KERNEL RowFit Reduce(Warp& w) const {
    int64_t b = bad;
    float mw = max_weight, ma = max_acc;
    for (int m = 1; m < kWarpSize; m <<= 1) {
      const int64_t o = w.shfl_xor(b, m);
      b = o < b ? o : b;
      mw = fmaxf(mw, w.shfl_xor(mw, m));
      ma = fmaxf(ma, w.shfl_xor(ma, m));
    }
    float v = bad == b && b != INT64_MAX ? value : 0.0f;
    for (int m = 1; m < kWarpSize; m <<= 1) v += w.shfl_xor(v, m);
    return RowFit{b == INT64_MAX, b == INT64_MAX ? -1 : b, v, mw, ma};
  }
};

// One optimizer update of `row`, whose merged gradient is the sum over k in
// [b, e) of meta's scaled rows of `grads` (its occurrences, or a hot row's
// chunk sums). Called by a whole warp. kDry: the same arithmetic with
// nothing stored, and what it would store judged (RowFit; overflow_guard.h).
template <typename Tag, bool kDry, typename Warp, typename Meta>
EMBER_KERNEL RowFit UpdateRow(Warp& w, const UpdateDesc& d, int64_t row, int64_t b, int64_t e,
                              const float* grads, Meta meta) {
  using T = typename Tag::Storage;
  const int lane = w.lane();
  const int64_t dim = d.dim;
  const math::StepParams& p = d.params;
  T* wr = static_cast<T*>(d.weights) + row * dim;
  float* st = d.state != nullptr ? d.state + row * d.state_width : nullptr;
  const uint64_t key = d.stochastic ? math::RowNoiseKey(d.seed, d.step, d.row_offset + row) : 0;
  const WarpGeometry g = MakeGeometry(dim, lane);
  const float limit = math::WeightLimit(d.weight_type);
  FitNote note;

  if (p.optimizer == math::kStepRowwiseAdagrad) {
    // The row's mean square needs the whole gradient first: one pass for
    // the sum of squares, a second for the update (the first chunk's
    // gradient is kept; wider rows gather again).
    double sq = 0;
    Vec4 first = {0.f, 0.f, 0.f, 0.f};
    for (int64_t cb = 0; cb < g.chunks; cb += g.group) {
      const int64_t c = cb + g.chunk_lane;
      const bool active = c < g.chunks;
      Vec4 gv = WarpGather<Fp32>(w, grads, b, e, 4 * c, active, g, meta);
      if (active && g.sub == 0) {
        gv = L2Gradient4(p, gv, Load4(Tag(), wr + 4 * c));
        sq += static_cast<double>(gv.x) * gv.x + static_cast<double>(gv.y) * gv.y +
              static_cast<double>(gv.z) * gv.z + static_cast<double>(gv.w) * gv.w;
      }
      if (cb == 0) first = gv;
    }
    for (int m = 1; m < kWarpSize; m <<= 1) sq += w.shfl_xor(sq, m);
    float mult = 0;
    if (lane == 0) {
      float acc = st[0];
      mult = math::RowwiseMultiplier(p, &acc, static_cast<float>(sq / static_cast<double>(dim)));
      if (kDry) {
        note.State(acc, dim, true);
      } else {
        st[0] = acc;
      }
    }
    mult = w.shfl(mult, 0);
    for (int64_t cb = 0; cb < g.chunks; cb += g.group) {
      const int64_t c = cb + g.chunk_lane;
      const bool active = c < g.chunks;
      Vec4 gv = first;
      if (cb != 0) gv = WarpGather<Fp32>(w, grads, b, e, 4 * c, active, g, meta);
      if (active && g.sub == 0) {
        Vec4 wv = Load4(Tag(), wr + 4 * c);
        if (cb != 0) gv = L2Gradient4(p, gv, wv);
        wv.x = math::RowwiseStep(p, wv.x, gv.x, mult);
        wv.y = math::RowwiseStep(p, wv.y, gv.y, mult);
        wv.z = math::RowwiseStep(p, wv.z, gv.z, mult);
        wv.w = math::RowwiseStep(p, wv.w, gv.w, mult);
        if (kDry) {
          note.Weights(wv, limit, 4 * c);
        } else {
          StoreUpdated<Tag>(d, wr + 4 * c, wv, key, 4 * c);
        }
      }
    }
    if (kDry) return note.Reduce(w);
    return RowFit{true, -1, 0.0f, 0.0f, 0.0f};
  }

  for (int64_t cb = 0; cb < g.chunks; cb += g.group) {
    const int64_t c = cb + g.chunk_lane;
    const bool active = c < g.chunks;
    const Vec4 gv = WarpGather<Fp32>(w, grads, b, e, 4 * c, active, g, meta);
    if (!active || g.sub != 0) continue;
    Vec4 wv = Load4(Tag(), wr + 4 * c);
    Vec4 s = {0.f, 0.f, 0.f, 0.f}, m = s, v = s;
    if (p.optimizer == math::kStepAdagrad) {
      s = Load4(Fp32(), st + 4 * c);
    } else if (p.optimizer == math::kStepAdam) {
      m = Load4(Fp32(), st + 4 * c);
      v = Load4(Fp32(), st + dim + 4 * c);
    }
    wv.x = math::ElementStep(p, wv.x, gv.x, &s.x, &m.x, &v.x);
    wv.y = math::ElementStep(p, wv.y, gv.y, &s.y, &m.y, &v.y);
    wv.z = math::ElementStep(p, wv.z, gv.z, &s.z, &m.z, &v.z);
    wv.w = math::ElementStep(p, wv.w, gv.w, &s.w, &m.w, &v.w);
    if (kDry) {
      note.Weights(wv, limit, 4 * c);
      if (p.optimizer == math::kStepAdagrad) {
        note.States(s, dim + 4 * c, true);
      } else if (p.optimizer == math::kStepAdam) {
        note.States(m, dim + 4 * c, false);
        note.States(v, 2 * dim + 4 * c, true);
      }
      continue;
    }
    StoreUpdated<Tag>(d, wr + 4 * c, wv, key, 4 * c);
    if (p.optimizer == math::kStepAdagrad) {
      Store4(Fp32(), st + 4 * c, s);
    } else if (p.optimizer == math::kStepAdam) {
      Store4(Fp32(), st + 4 * c, m);
      Store4(Fp32(), st + dim + 4 * c, v);
    }
  }
  if (kDry) return note.Reduce(w);
  return RowFit{true, -1, 0.0f, 0.0f, 0.0f};
}

// Row `row` of shard d as kMode says (UpdateMode; kGuarded: a guarded
// apply), its merged gradient the sum over k in [b, e) of meta's scaled
// rows of `grads`. One instantiation a kernel, so the plain update's kernel
// holds the update alone (its registers and code as they were).
template <int kMode, bool kGuarded, typename Tag, typename Warp, typename Meta>
EMBER_KERNEL void UpdateOrCheck(Warp& w, const UpdateArgs& a, const UpdateDesc& d, int64_t row,
                                uint64_t key, int64_t b, int64_t e, const float* grads,
                                Meta meta) {
  OverflowRecord* rec = a.record;
  const bool guarded = d.guard || a.guard_all;
  if constexpr (kMode == kApplyRows) {
    if (kGuarded && guarded) {
      const RowFit f = UpdateRow<Tag, true>(w, d, row, b, e, grads, meta);
      if (!f.fits) {
        if (w.lane() == 0) AtomicAddU64(&rec->skipped, 1);
        return;
      }
      if (w.lane() == 0) {
        AtomicMaxU32(&rec->max_weight_bits, FloatBitsOf(f.max_weight));
        AtomicMaxU32(&rec->max_acc_bits, FloatBitsOf(f.max_acc));
      }
    }
    UpdateRow<Tag, false>(w, d, row, b, e, grads, meta);
  } else if constexpr (kMode == kCheckRows) {
    if (!guarded) return;
    const RowFit f = UpdateRow<Tag, true>(w, d, row, b, e, grads, meta);
    if (w.lane() != 0) return;
    if (!f.fits) {
      AtomicMinU64(&rec->first_key, static_cast<unsigned long long>(key));  // NOLINT
    } else {
      AtomicMaxU32(&rec->max_weight_bits, FloatBitsOf(f.max_weight));
      AtomicMaxU32(&rec->max_acc_bits, FloatBitsOf(f.max_acc));
    }
  } else {
    if (key != rec->first_key) return;  // kReportRow: one warp owns the row
    const RowFit f = UpdateRow<Tag, true>(w, d, row, b, e, grads, meta);
    if (w.lane() == 0) {
      rec->bad = f.bad;
      rec->value = f.value;
    }
  }
}

template <int kMode, bool kGuarded, typename Tag, typename Warp>
EMBER_KERNEL void UpdateRun(Warp& w, const UpdateArgs& a, const UpdateDesc& d, int64_t row,
                            uint64_t key, int64_t u, int64_t b, int64_t e) {
  if (e - b > kHotRun) {  // the run's chunk sums
    const int64_t stride = a.partial_stride;
    auto chunk_sums = [stride](int64_t k, int64_t* off, float* s) {
      *off = k * stride;
      *s = 1.0f;
    };
    UpdateOrCheck<kMode, kGuarded, Tag>(w, a, d, row, key, u == 0 ? 0 : a.hot_end[u - 1],
                                        a.hot_end[u], a.partials, chunk_sums);
    return;
  }
  const int64_t* positions = a.sorted_positions;
  const int64_t* src_off = a.src_off;
  const float* scale = a.scale;
  auto occurrences = [positions, src_off, scale](int64_t k, int64_t* off, float* s) {
    const int64_t q = positions[k];
    *off = src_off[q];
    *s = scale[q];
  };
  UpdateOrCheck<kMode, kGuarded, Tag>(w, a, d, row, key, b, e, a.grads, occurrences);
}

// One warp per run of equal sorted keys (a unique (shard, row)); each row is
// owned by exactly one warp, so no atomics (but the checks' record's).
// kMode and kGuarded are a.mode and a.guarded_apply (UpdateWarpAs picks).
template <int kMode, bool kGuarded, typename Warp>
EMBER_KERNEL void UpdateWarp(Warp& w, int64_t warp, int64_t warps, const UpdateArgs& a) {
  const int64_t num_runs = *a.num_runs;
  for (int64_t u = warp; u < num_runs; u += warps) {
    const int64_t b = a.run_begin[u], e = a.run_begin[u + 1];
    const uint64_t key = a.sorted_keys[b];
    const int64_t s = UpperBound(a.key_base, a.num_shards + 1, key) - 1;
    const UpdateDesc d = a.shards[s];
    const int64_t row = static_cast<int64_t>(key - a.key_base[s]);
    switch (d.weight_type) {
      case kFp16:
        UpdateRun<kMode, kGuarded, Fp16>(w, a, d, row, key, u, b, e);
        break;
      case kBf16:
        UpdateRun<kMode, kGuarded, Bf16>(w, a, d, row, key, u, b, e);
        break;
      default:
        UpdateRun<kMode, kGuarded, Fp32>(w, a, d, row, key, u, b, e);
    }
  }
}

// UpdateWarp as a.mode and a.guarded_apply say (host code: the device
// launches its kernel per instantiation).
template <typename Warp>
EMBER_KERNEL void UpdateWarpAs(Warp& w, int64_t warp, int64_t warps, const UpdateArgs& a) {
  if (a.mode == kCheckRows) return UpdateWarp<kCheckRows, false>(w, warp, warps, a);
  if (a.mode == kReportRow) return UpdateWarp<kReportRow, false>(w, warp, warps, a);
  if (a.guarded_apply) return UpdateWarp<kApplyRows, true>(w, warp, warps, a);
  UpdateWarp<kApplyRows, false>(w, warp, warps, a);
}

}  // namespace kernels
}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_KERNEL_BODIES_H_
