// dynamic_bench: a dynamic (hash-keyed) table against the fixed table it
// stands beside, in one run: the same rows, dims, ids and threads, one
// backend under both (the dynamic one through WithDynamicShards): the CPU
// backend, or with --backend=cuda the CUDA backend on GPU 0, which finds
// the dynamic table's ids on the device (FindsKeys; host ids and outputs,
// so each call's copies are timed too; --device_resident adds lookups whose
// ids and outputs stay in device memory: the device's find and gather
// alone, the first call of each checked against the host path's output).
// A benchmark, not a test.
//
//   bazel run -c opt //bench:dynamic_bench -- [--backend=cpu|cuda] --rows=1000000 --dim=64 --threads=1
//       --distribution=uniform|zipf [--batch=2048 --pooling_factor=20 --iters=20 --id_sets=8]
//       [--new_fraction=0.1] [--format=table|json]
//
// The dynamic table holds --rows ids (random int64 hashes, imported) at
// capacity --rows; the fixed one --rows rows. Each call's ids are the same
// draw for both: row r of the fixed table is the r-th id of the dynamic one.
//
//   lookup        keys/s of the fused SUM lookup, each, and dynamic / fixed
//   update        keys/s of the fused backward + SGD step on held ids
//   admit         keys/s of updates where --new_fraction of the ids are new
//                 (admitted on their first update, each evicting the LRU row)
//                 against the fixed table's update of the same shape
//   find, touch,  the bare index (DynamicIndex): ids found per second (all
//   insert        held); ids of held rows through an update's bookkeeping
//                 (BeginUpdate + Commit, no rows written); new ids inserted
//                 per second into a full shard (each evicting one)
//   bytes/row     the fixed table's row (weights + optimizer state) and the
//                 dynamic one's (the row, its slot bookkeeping and index
//                 entries at the load factor kept)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#define EMBER_BENCH_DEVICE 1
#endif

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gflags/gflags.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/dynamic/dynamic_index.h"

DEFINE_string(backend, "cpu", "cpu, or cuda (GPU 0).");
DEFINE_int64(rows, 1000000, "Rows of each table (the dynamic one's capacity and ids held).");
DEFINE_int32(dim, 64, "Embedding dimension.");
DEFINE_int32(batch, 2048, "Bags per call.");
DEFINE_int32(pooling_factor, 20, "Ids per bag.");
DEFINE_int32(threads, 1, "Backend threads per call.");
DEFINE_string(distribution, "uniform", "uniform or zipf (alpha 1.05, hot rows scattered).");
DEFINE_int32(iters, 20, "Timed calls per measurement (the best of 3 rounds counts).");
DEFINE_int32(id_sets, 8, "Batches of ids the calls cycle through.");
DEFINE_double(new_fraction, 0.1, "admit: the fraction of each call's ids that are new.");
DEFINE_string(format, "table", "table or json.");
DEFINE_uint64(seed, 1, "Random seed.");
DEFINE_bool(device_resident, false,
            "cuda: also time lookups with ids and outputs in device memory (no host copies).");
DEFINE_string(only, "", "Run one part (lookup, update, admit, find, touch, insert) and print its rate alone (profiling).");

namespace eb = ember::backend;

namespace {

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "dynamic_bench: %s: %s\n", what, std::string(s.message()).c_str());
  std::exit(1);
}

#ifdef EMBER_BENCH_DEVICE
void DieCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "dynamic_bench: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// Device memory for --device_resident, freed at exit.
class DeviceBlocks {
 public:
  ~DeviceBlocks() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  T* Alloc(size_t n) {
    void* p = nullptr;
    DieCuda(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  const T* Upload(const std::vector<T>& v) {
    T* p = Alloc<T>(v.size());
    DieCuda(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, nullptr),
            "upload");
    DieCuda(cudaStreamSynchronize(nullptr), "upload");
    return p;
  }

 private:
  std::vector<void*> blocks_;
};
#endif

eb::ShardSpec Spec(bool dynamic) {
  eb::ShardSpec s;
  s.table = dynamic ? "dynamic" : "fixed";
  s.rows = s.table_rows = FLAGS_rows;
  s.dim = FLAGS_dim;
  s.optimizer.type = eb::OptimizerType::kSgd;
  s.is_dynamic = dynamic;
  return s;
}

// Keys per second of `call` over `keys` keys a call: the best of 3 rounds
// of --iters calls.
template <typename F>
double Rate(int64_t keys, F call) {
  call(0);  // warm
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    const absl::Time start = absl::Now();
    for (int i = 0; i < FLAGS_iters; ++i) call(i);
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    best = std::max(best, static_cast<double>(keys) * FLAGS_iters / s);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (FLAGS_rows <= 0 || FLAGS_dim <= 0 || FLAGS_batch <= 0 || FLAGS_pooling_factor <= 0 ||
      FLAGS_iters <= 0 || FLAGS_id_sets <= 0 || FLAGS_new_fraction < 0 ||
      FLAGS_new_fraction > 1 || (FLAGS_distribution != "uniform" && FLAGS_distribution != "zipf") ||
      (FLAGS_format != "table" && FLAGS_format != "json") ||
      (FLAGS_backend != "cpu" && FLAGS_backend != "cuda") ||
      (FLAGS_device_resident && FLAGS_backend != "cuda")) {
    std::fprintf(stderr, "dynamic_bench: bad flags (see --help)\n");
    return 2;
  }
  auto make = []() -> absl::StatusOr<std::unique_ptr<eb::EmbeddingBackend>> {
    if (FLAGS_backend == "cuda") return eb::CreateCudaBackend({});
    eb::CpuBackendOptions o;
    o.num_threads = FLAGS_threads;
    return eb::CreateCpuBackend(o);
  };
  auto fixed_be = make();
  Die(fixed_be.status(), "backend");
  auto inner = make();
  Die(inner.status(), "backend");
  auto dyn_be = eb::WithDynamicShards(*std::move(inner));
  auto fixed = (*fixed_be)->CreateShard(Spec(false));
  Die(fixed.status(), "fixed shard");
  auto dyn = dyn_be->CreateShard(Spec(true));
  Die(dyn.status(), "dynamic shard");

  // The dynamic table's ids: random hashes, distinct; imported in chunks.
  std::mt19937_64 rng(FLAGS_seed);
  std::vector<int64_t> held(FLAGS_rows);
  for (int64_t r = 0; r < FLAGS_rows; ++r) {
    held[r] = static_cast<int64_t>(ember::MixId(static_cast<int64_t>(FLAGS_seed) * 1000003 + r));
  }
  std::fprintf(stderr, "dynamic_bench: importing %lld ids ...\n",
               static_cast<long long>(FLAGS_rows));
  const int64_t chunk = 1 << 16;
  std::vector<float> zeros(chunk * FLAGS_dim, 0.01f);
  for (int64_t b = 0; b < FLAGS_rows; b += chunk) {
    const int64_t n = std::min(chunk, FLAGS_rows - b);
    Die(dyn_be->ImportIds(*dyn, absl::MakeConstSpan(held).subspan(b, n),
                          absl::MakeConstSpan(zeros).first(n * FLAGS_dim), {}),
        "import");
  }

  // Id sets: row positions, the same for both tables.
  const int64_t n = static_cast<int64_t>(FLAGS_batch) * FLAGS_pooling_factor;
  std::vector<std::vector<int64_t>> rows_of(FLAGS_id_sets, std::vector<int64_t>(n)),
      ids_of(FLAGS_id_sets, std::vector<int64_t>(n));
  std::vector<double> cdf;
  if (FLAGS_distribution == "zipf") {
    cdf.resize(FLAGS_rows);
    double acc = 0;
    for (int64_t r = 0; r < FLAGS_rows; ++r) cdf[r] = (acc += 1.0 / std::pow(r + 1.0, 1.05));
  }
  std::uniform_int_distribution<int64_t> uniform(0, FLAGS_rows - 1);
  for (int k = 0; k < FLAGS_id_sets; ++k) {
    for (int64_t i = 0; i < n; ++i) {
      int64_t r = uniform(rng);
      if (!cdf.empty()) {
        std::uniform_real_distribution<double> u(0, cdf.back());
        const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
        r = static_cast<int64_t>((static_cast<uint64_t>(rank) * 2654435761ULL) % FLAGS_rows);
      }
      rows_of[k][i] = r;
      ids_of[k][i] = held[r];
    }
  }
  const std::vector<int64_t> lengths(FLAGS_batch, FLAGS_pooling_factor);
  std::vector<float> out(static_cast<size_t>(FLAGS_batch) * FLAGS_dim);
  std::vector<float> grad(static_cast<size_t>(FLAGS_batch) * FLAGS_dim, 1e-6f);
  auto lookup = [&](eb::EmbeddingBackend* be, eb::ShardId id,
                    const std::vector<std::vector<int64_t>>& sets) {
    return Rate(n, [&](int i) {
      const eb::LookupRequest r{
          eb::FeatureRequest{id, eb::Pooling::kSum, lengths, sets[i % FLAGS_id_sets], {}},
          absl::MakeSpan(out)};
      Die(be->Lookup({r}), "lookup");
    });
  };
  auto update = [&](eb::EmbeddingBackend* be, eb::ShardId id,
                    const std::vector<std::vector<int64_t>>& sets) {
    return Rate(n, [&](int i) {
      const eb::GradientRequest r{
          eb::FeatureRequest{id, eb::Pooling::kSum, lengths, sets[i % FLAGS_id_sets], {}}, grad};
      Die(be->ApplyGradients({r}), "update");
    });
  };
  // One part alone (profiling): its rate only.
  auto alone = [](const char* what, double rate) {
    std::printf("%s %.1f M keys/s\n", what, rate / 1e6);
    return 0;
  };
  // Ids and outputs in device memory (--device_resident): the first call of
  // each table checked against the host path's output for the same ids.
  double lookup_fixed_dev = 0, lookup_dyn_dev = 0;
#ifdef EMBER_BENCH_DEVICE
  DeviceBlocks device;
  if (FLAGS_device_resident) {
    std::vector<const int64_t*> rows_dev, ids_dev;
    for (int k = 0; k < FLAGS_id_sets; ++k) {
      rows_dev.push_back(device.Upload(rows_of[k]));
      ids_dev.push_back(device.Upload(ids_of[k]));
    }
    const size_t out_floats = static_cast<size_t>(FLAGS_batch) * FLAGS_dim;
    float* out_dev = device.Alloc<float>(out_floats);
    auto call = [&](eb::EmbeddingBackend* be, eb::ShardId id, const int64_t* ids) {
      eb::FeatureRequest f{id, eb::Pooling::kSum, lengths, absl::MakeConstSpan(ids, n), {}};
      f.on_device = true;
      eb::LookupRequest r{f, absl::MakeSpan(out_dev, out_floats)};
      r.output_on_device = true;
      Die(be->Lookup({r}), "device-resident lookup");
    };
    auto check = [&](eb::EmbeddingBackend* be, eb::ShardId id, const int64_t* ids_on_device,
                     const std::vector<int64_t>& ids_on_host) {
      call(be, id, ids_on_device);
      std::vector<float> got(out_floats);
      DieCuda(cudaMemcpyAsync(got.data(), out_dev, out_floats * sizeof(float),
                              cudaMemcpyDeviceToHost, nullptr),
              "download");
      DieCuda(cudaStreamSynchronize(nullptr), "download");
      const eb::LookupRequest r{
          eb::FeatureRequest{id, eb::Pooling::kSum, lengths, ids_on_host, {}}, absl::MakeSpan(out)};
      Die(be->Lookup({r}), "lookup");
      if (got != out) {
        std::fprintf(stderr, "dynamic_bench: device-resident lookup differs from the host path's\n");
        std::exit(1);
      }
    };
    check(fixed_be->get(), *fixed, rows_dev[0], rows_of[0]);
    check(dyn_be.get(), *dyn, ids_dev[0], ids_of[0]);
    lookup_fixed_dev = Rate(n, [&](int i) { call(fixed_be->get(), *fixed, rows_dev[i % FLAGS_id_sets]); });
    lookup_dyn_dev = Rate(n, [&](int i) { call(dyn_be.get(), *dyn, ids_dev[i % FLAGS_id_sets]); });
  }
#else
  if (FLAGS_device_resident) {
    std::fprintf(stderr, "dynamic_bench: --device_resident needs a build with CUDA\n");
    return 2;
  }
#endif
  if (FLAGS_only == "lookup") return alone("lookup dynamic", lookup(dyn_be.get(), *dyn, ids_of));
  if (FLAGS_only == "update") return alone("update dynamic", update(dyn_be.get(), *dyn, ids_of));
  const bool all = FLAGS_only.empty();
  const double lookup_fixed = all ? lookup(fixed_be->get(), *fixed, rows_of) : 0;
  const double lookup_dyn = all ? lookup(dyn_be.get(), *dyn, ids_of) : 0;
  const double update_fixed = all ? update(fixed_be->get(), *fixed, rows_of) : 0;
  const double update_dyn = all ? update(dyn_be.get(), *dyn, ids_of) : 0;
  // Admission: a fraction of each call's ids new (fresh every call).
  int64_t next_new = int64_t{1} << 62;
  std::vector<int64_t> admit_ids(n);
  std::bernoulli_distribution is_new(FLAGS_new_fraction);
  auto admit = [&](int i) {
    const std::vector<int64_t>& base = ids_of[i % FLAGS_id_sets];
    for (int64_t k = 0; k < n; ++k) admit_ids[k] = is_new(rng) ? next_new++ : base[k];
    const eb::GradientRequest r{eb::FeatureRequest{*dyn, eb::Pooling::kSum, lengths, admit_ids, {}},
                                grad};
    Die(dyn_be->ApplyGradients({r}), "admit");
  };
  if (FLAGS_only == "admit") return alone("admit dynamic", Rate(n, admit));
  const double admit_dyn = all ? Rate(n, admit) : 0;

  // The bare index: finds of held ids, inserts of new ones into a full shard.
  eb::DynamicIndex index(FLAGS_rows, eb::DynamicConfig{});
  for (int64_t b = 0; b < FLAGS_rows; b += chunk) {
    const int64_t m = std::min(chunk, FLAGS_rows - b);
    auto c = index.BeginImport(absl::MakeConstSpan(held).subspan(b, m));
    Die(c.status(), "index import");
    index.Commit();
  }
  std::vector<int64_t> slots(n);
  const double find = Rate(n, [&](int i) {
    index.FindAll(ids_of[i % FLAGS_id_sets], -1, slots.data());
  });
  if (FLAGS_only == "find") return alone("find", find);
  // An update's bookkeeping alone: held ids marked updated (no rows written).
  const double touch = Rate(n, [&](int i) {
    index.BeginUpdate(ids_of[i % FLAGS_id_sets], -1, slots.data());
    index.Commit();
  });
  if (FLAGS_only == "touch") return alone("touch", touch);
  std::vector<int64_t> fresh(n);
  const double insert = Rate(n, [&](int) {
    for (int64_t k = 0; k < n; ++k) fresh[k] = next_new++;
    index.BeginUpdate(fresh);
    index.Commit();
  });
  if (FLAGS_only == "insert") return alone("insert", insert);

  const eb::DynamicStats st = *dyn_be->GetDynamicStats(*dyn);
  const double row_bytes = 4.0 * FLAGS_dim;  // fp32, SGD: no state
  const double dyn_row_bytes =
      row_bytes * (FLAGS_rows + 1) / FLAGS_rows + 32.0 +  // slot bookkeeping (Meta)
      16.0 * static_cast<double>(st.index_slots) / FLAGS_rows;
  if (FLAGS_format == "json") {
    std::printf(
        "{\"backend\": \"%s\", \"rows\": %lld, \"dim\": %d, \"threads\": %d, "
        "\"distribution\": \"%s\", "
        "\"lookup_fixed\": %.0f, \"lookup_dynamic\": %.0f, \"lookup_ratio\": %.3f, "
        "\"update_fixed\": %.0f, \"update_dynamic\": %.0f, \"update_ratio\": %.3f, "
        "\"admit_dynamic\": %.0f, \"admit_ratio\": %.3f, \"new_fraction\": %.2f, "
        "\"find\": %.0f, \"touch\": %.0f, \"insert\": %.0f, \"bytes_per_row_fixed\": %.1f, "
        "\"bytes_per_row_dynamic\": %.1f, \"lookup_fixed_device\": %.0f, "
        "\"lookup_dynamic_device\": %.0f}\n",
        FLAGS_backend.c_str(), static_cast<long long>(FLAGS_rows), FLAGS_dim, FLAGS_threads,
        FLAGS_distribution.c_str(), lookup_fixed, lookup_dyn, lookup_dyn / lookup_fixed, update_fixed, update_dyn,
        update_dyn / update_fixed, admit_dyn, admit_dyn / update_fixed, FLAGS_new_fraction, find,
        touch, insert, row_bytes, dyn_row_bytes, lookup_fixed_dev, lookup_dyn_dev);
    return 0;
  }
  std::printf("%s backend, rows %lld, dim %d, %d thread(s), %s ids, %d x %d ids a call\n",
              FLAGS_backend.c_str(), static_cast<long long>(FLAGS_rows), FLAGS_dim, FLAGS_threads,
              FLAGS_distribution.c_str(), FLAGS_batch, FLAGS_pooling_factor);
  std::printf("  lookup   fixed %8.1f M keys/s   dynamic %8.1f M keys/s   ratio %.3f\n",
              lookup_fixed / 1e6, lookup_dyn / 1e6, lookup_dyn / lookup_fixed);
  if (FLAGS_device_resident) {
    std::printf("  lookup, ids and outputs on the device: fixed %8.1f M keys/s   dynamic %8.1f M keys/s   ratio %.3f\n",
                lookup_fixed_dev / 1e6, lookup_dyn_dev / 1e6, lookup_dyn_dev / lookup_fixed_dev);
  }
  std::printf("  update   fixed %8.1f M keys/s   dynamic %8.1f M keys/s   ratio %.3f\n",
              update_fixed / 1e6, update_dyn / 1e6, update_dyn / update_fixed);
  std::printf("  admit    (%.0f%% new)            dynamic %8.1f M keys/s   ratio %.3f (of fixed update)\n",
              100 * FLAGS_new_fraction, admit_dyn / 1e6, admit_dyn / update_fixed);
  std::printf("  index    find %8.1f   touch %8.1f   insert (evicting) %8.1f M keys/s\n",
              find / 1e6, touch / 1e6, insert / 1e6);
  std::printf("  bytes/row  fixed %.1f   dynamic %.1f\n", row_bytes, dyn_row_bytes);
  return 0;
}
