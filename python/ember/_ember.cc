// _ember: the Python SDK's extension module, a thin binding of the C++
// client (client/client.h). The routing is the C++ client's; nothing is
// re-implemented here. Control-plane results cross as JSON (the proto3 JSON
// mapping, proto field names); arrays cross as NumPy arrays: inputs are
// read once into the KJT, outputs are handed to NumPy without a copy. Every
// RPC runs with the GIL released. Errors raise ember's exception classes
// (ember/_errors.py) carrying the absl status code and the server's message.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "planner/plan_format.h"
#include "server/common/tls.h"
#include "google/protobuf/util/json_util.h"

namespace py = pybind11;

namespace ember {
namespace {

using client::Client;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using client::SequenceEmbedding;

// An absl error on its way to Python (see the translator below).
struct StatusError {
  int code;
  std::string message;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError{static_cast<int>(s.code()), std::string(s.message())};
}

// A device KJT from the raw addresses Python passes (tensors' data_ptr()).
client::DeviceKjt DeviceKjtOf(std::vector<std::string> keys, int64_t batch, uintptr_t lengths,
                              uintptr_t values, int64_t num_values, uintptr_t weights) {
  client::DeviceKjt kjt;
  kjt.keys = std::move(keys);
  kjt.batch_size = batch;
  kjt.lengths = reinterpret_cast<const int64_t*>(lengths);
  kjt.values = reinterpret_cast<const int64_t*>(values);
  kjt.num_values = num_values;
  kjt.weights = reinterpret_cast<const float*>(weights);
  return kjt;
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  Check(v.status());
  return *std::move(v);
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

template <typename M>
M FromJson(const std::string& json, const char* what) {
  M m;
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = false;
  if (auto s = google::protobuf::util::JsonStringToMessage(json, &m, o); !s.ok()) {
    throw StatusError{static_cast<int>(absl::StatusCode::kInvalidArgument),
                      std::string(what) + ": " + s.ToString()};
  }
  return m;
}

// A vector's buffer handed to NumPy (no copy), shaped [rows, cols].
template <typename Vector>
py::array_t<float> ToNumpy(Vector v, int64_t rows, int64_t cols) {
  auto* owned = new Vector(std::move(v));
  py::capsule free(owned, [](void* p) { delete static_cast<Vector*>(p); });
  return py::array_t<float>({rows, cols}, {cols * sizeof(float), sizeof(float)}, owned->data(),
                            free);
}

// Ids handed to NumPy (no copy), int64 [n].
py::array_t<int64_t> IdsToNumpy(std::vector<int64_t> v) {
  auto* owned = new std::vector<int64_t>(std::move(v));
  py::capsule free(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  const py::ssize_t n = static_cast<py::ssize_t>(owned->size());
  return py::array_t<int64_t>({n}, {static_cast<py::ssize_t>(sizeof(int64_t))}, owned->data(),
                              free);
}

template <typename T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
absl::Span<const T> SpanOf(const CArray<T>& a) {
  return absl::Span<const T>(a.data(), static_cast<size_t>(a.size()));
}

// One call's KJT: the caller's arrays as C-contiguous arrays of the right
// dtype (the same memory when they already are, a converted copy only when
// not), held for the call, and the view the client reads them through.
struct KjtArgs {
  KjtArgs(std::vector<std::string> k, const py::object& lengths, const py::object& values,
          const py::object& weights)
      : keys(std::move(k)),
        lengths(lengths),
        values(values),
        weighted(!weights.is_none()),
        weights(weighted ? CArray<float>(weights) : CArray<float>(0)) {}

  client::KjtView View() const {
    return {keys, SpanOf(lengths), SpanOf(values),
            weighted ? SpanOf(weights) : absl::Span<const float>()};
  }

  std::vector<std::string> keys;
  CArray<int64_t> lengths, values;
  bool weighted;
  CArray<float> weights;
};

}  // namespace
}  // namespace ember

PYBIND11_MODULE(_ember, m) {
  using namespace ember;
  m.doc() = "Ember's C++ client, for the ember package (use ember.Client).";
  // pybind11 looks NumPy's C API up once, on first use, in a function-local
  // static; two threads making their first calls at once (each releasing the
  // GIL) could deadlock on it. Looked up here, under the import's GIL.
  (void)py::detail::npy_api::get();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object cls = py::module_::import("ember._errors").attr("error_class")(e.code);
      py::object err = cls(e.code, e.message);
      PyErr_SetObject(cls.ptr(), err.ptr());
    }
  });

  py::class_<Client>(m, "Client")
      .def(py::init([](const std::string& address, double timeout_s,
                       const std::string& auth_token, const std::string& tls_ca,
                       const std::string& tls_cert, const std::string& tls_key,
                       bool shared_memory, const std::string& shm_dir, int keep_freed_heap_mib,
                       const std::string& link, int link_device) {
             client::ClientOptions o;
             o.timeout = absl::Seconds(timeout_s);
             o.auth_token = auth_token;
             o.shared_memory = shared_memory;
             o.shm_dir = shm_dir;
             o.keep_freed_heap_mib = keep_freed_heap_mib;
             o.link = link;
             o.link_device = link_device;
             o.credentials = Value(ChannelCredentialsFrom({tls_cert, tls_key, tls_ca}));
             py::gil_scoped_release release;
             return Value(Client::Connect(address, o));
           }),
           py::arg("address"), py::arg("timeout_s"), py::arg("auth_token") = "",
           py::arg("tls_ca") = "", py::arg("tls_cert") = "", py::arg("tls_key") = "",
           py::arg("shared_memory") = true, py::arg("shm_dir") = "",
           py::arg("keep_freed_heap_mib") = 256, py::arg("link") = "",
           py::arg("link_device") = 0)
      .def("create_collection",
           [](Client& c, const std::string& spec_json, const std::string& sharding_type) {
             auto spec = FromJson<ember::v1::CollectionSpec>(spec_json, "collection spec");
             absl::StatusOr<ember::v1::CollectionInfo> info;
             {
               py::gil_scoped_release release;
               info = c.CreateCollection(spec, sharding_type);
             }
             return ToJson(Value(std::move(info)));
           })
      .def("create_collection_with_plan",
           [](Client& c, const std::string& spec_json, const std::string& plan_json) {
             auto spec = FromJson<ember::v1::CollectionSpec>(spec_json, "collection spec");
             auto plan = Value(planner::ParsePlanJson(plan_json));
             absl::StatusOr<ember::v1::CollectionInfo> info;
             {
               py::gil_scoped_release release;
               info = c.CreateCollectionWithPlan(spec, plan);
             }
             return ToJson(Value(std::move(info)));
           })
      .def("get_collection",
           [](Client& c, const std::string& name) {
             py::gil_scoped_release release;
             return ToJson(Value(c.GetCollection(name)));
           })
      .def("list_collections",
           [](Client& c) {
             std::vector<std::string> out;
             py::gil_scoped_release release;
             for (const auto& info : Value(c.ListCollections())) out.push_back(ToJson(info));
             return out;
           })
      .def("drop_collection",
           [](Client& c, const std::string& name) {
             py::gil_scoped_release release;
             Check(c.DropCollection(name));
           })
      .def("list_workers",
           [](Client& c) {
             py::gil_scoped_release release;
             return ToJson(Value(c.ListWorkers()));
           })
      .def("worker_status",
           [](Client& c, const std::string& address) {
             py::gil_scoped_release release;
             return ToJson(Value(c.WorkerStatus(address)));
           })
      .def("preview_plan",
           [](Client& c, const std::string& spec_json, const std::string& topology_json,
              const std::string& sharding_type) {
             auto spec = FromJson<ember::v1::CollectionSpec>(spec_json, "collection spec");
             auto topology = FromJson<ember::v1::Topology>(topology_json, "topology");
             py::gil_scoped_release release;
             return ToJson(Value(c.PreviewPlan(spec, topology, sharding_type)));
           })
      .def("lookup",
           [](Client& c, const std::string& name, std::vector<std::string> keys,
              py::object lengths, py::object values, py::object weights, int64_t step) {
             const KjtArgs kjt(std::move(keys), lengths, values, weights);
             absl::StatusOr<KeyedTensor> kt;
             {
               py::gil_scoped_release release;
               kt = c.Lookup(name, kjt.View(), client::StepTag{step, -1});
             }
             KeyedTensor t = Value(std::move(kt));
             const int64_t width = t.row_width();
             return py::make_tuple(t.keys, t.length_per_key,
                                   ToNumpy(std::move(t.values), t.batch_size, width));
           })
      .def("prefetch",
           [](Client& c, const std::string& name, std::vector<std::string> keys,
              py::object lengths, py::object values) {
             const KjtArgs kjt(std::move(keys), lengths, values, py::none());
             absl::StatusOr<int64_t> brought;
             {
               py::gil_scoped_release release;
               brought = c.Prefetch(name, kjt.View());
             }
             return Value(std::move(brought));
           })
      .def("apply_gradients",
           [](Client& c, const std::string& name, std::vector<std::string> keys,
              py::object lengths, py::object values, py::object weights,
              std::vector<std::string> grad_keys, std::vector<int64_t> length_per_key,
              const CArray<float>& grads,
              const std::string& request_id, int64_t step, int32_t rank) {
             const KjtArgs kjt(std::move(keys), lengths, values, weights);
             client::KeyedTensorView g;
             g.keys = grad_keys;
             g.length_per_key = length_per_key;
             g.batch_size = grads.ndim() == 2 ? grads.shape(0) : 0;
             g.values = SpanOf(grads);
             std::string used;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.ApplyGradients(name, kjt.View(), g, request_id, &used,
                                    client::StepTag{step, rank});
             }
             if (!s.ok()) {  // the id goes with the error, for a retry that finishes the job
               throw StatusError{static_cast<int>(s.code()),
                                 std::string(s.message()) + " [request_id " + used + "]"};
             }
             return used;
           })
      // Device KJTs (Client::LookupOnDevice): raw addresses of contiguous
      // int64 lengths/values, float32 weights (0: none) and output, in the
      // memory the client's link reads (a CUDA tensor's for "nccl", host
      // memory for "socket"); ember.torch passes its tensors' data_ptr().
      .def("lookup_on_device",
           [](Client& c, const std::string& name, std::vector<std::string> keys, int64_t batch,
              uintptr_t lengths, uintptr_t values, int64_t num_values, uintptr_t weights,
              uintptr_t out, int64_t out_floats, int64_t step) {
             const client::DeviceKjt kjt =
                 DeviceKjtOf(std::move(keys), batch, lengths, values, num_values, weights);
             Client::Layout layout;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.LookupOnDevice(name, kjt, reinterpret_cast<float*>(out), out_floats, &layout,
                                    client::StepTag{step, -1});
             }
             Check(s);
             return std::make_pair(layout.keys, layout.dims);
           })
      .def("apply_gradients_on_device",
           [](Client& c, const std::string& name, std::vector<std::string> keys, int64_t batch,
              uintptr_t lengths, uintptr_t values, int64_t num_values, uintptr_t weights,
              uintptr_t grads, int64_t grad_floats, const std::string& request_id,
              int64_t step, int32_t rank) {
             const client::DeviceKjt kjt =
                 DeviceKjtOf(std::move(keys), batch, lengths, values, num_values, weights);
             std::string used;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.ApplyGradientsOnDevice(name, kjt, reinterpret_cast<const float*>(grads),
                                            grad_floats, request_id, &used,
                                            client::StepTag{step, rank});
             }
             if (!s.ok()) {
               throw StatusError{static_cast<int>(s.code()),
                                 std::string(s.message()) + " [request_id " + used + "]"};
             }
             return used;
           })
      .def("lookup_sequence",
           [](Client& c, const std::string& name, std::vector<std::string> keys,
              py::object lengths, py::object values, int64_t step) {
             const KjtArgs kjt(std::move(keys), lengths, values, py::none());
             absl::StatusOr<std::vector<SequenceEmbedding>> out;
             {
               py::gil_scoped_release release;
               out = c.LookupSequence(name, kjt.View(), client::StepTag{step, -1});
             }
             py::list result;
             for (SequenceEmbedding& e : Value(std::move(out))) {
               const int64_t rows = e.dim > 0 ? static_cast<int64_t>(e.values.size()) / e.dim : 0;
               result.append(py::make_tuple(e.key, ToNumpy(std::move(e.values), rows, e.dim)));
             }
             return result;
           })
      .def("apply_sequence_gradients",
           [](Client& c, const std::string& name, std::vector<std::string> keys,
              py::object lengths, py::object values, py::list grads,
              const std::string& request_id, int64_t step, int32_t rank) {
             const KjtArgs kjt(std::move(keys), lengths, values, py::none());
             // The blocks as C-contiguous float32 arrays (in place when they
             // are), held for the call.
             std::vector<CArray<float>> arrays;
             std::vector<client::SequenceEmbeddingView> g;
             for (py::handle item : grads) {
               auto pair = item.cast<py::tuple>();
               arrays.emplace_back(py::reinterpret_borrow<py::object>(pair[1]));
               const CArray<float>& a = arrays.back();
               g.push_back({pair[0].cast<std::string>(), a.ndim() == 2 ? a.shape(1) : 0,
                            SpanOf(a)});
             }
             std::string used;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.ApplySequenceGradients(name, kjt.View(), g, request_id, &used,
                                            client::StepTag{step, rank});
             }
             if (!s.ok()) {
               throw StatusError{static_cast<int>(s.code()),
                                 std::string(s.message()) + " [request_id " + used + "]"};
             }
             return used;
           })
      .def("export_table",
           [](Client& c, const std::string& name, const std::string& table) {
             int64_t rows = 0, dim = 0;
             absl::StatusOr<std::vector<float>> v;
             {
               py::gil_scoped_release release;
               v = c.ExportTable(name, table, &rows, &dim);
             }
             return ToNumpy(Value(std::move(v)), rows, dim);
           })
      .def("import_table",
           [](Client& c, const std::string& name, const std::string& table,
              py::array_t<float, py::array::c_style | py::array::forcecast> values) {
             if (values.ndim() != 2) {
               throw StatusError{static_cast<int>(absl::StatusCode::kInvalidArgument),
                                 "import_table needs a 2-d array [rows, dim]"};
             }
             const int64_t rows = values.shape(0), dim = values.shape(1);
             absl::Span<const float> span(values.data(), values.size());
             py::gil_scoped_release release;
             Check(c.ImportTable(name, table, span, rows, dim));
           })
      .def("export_dynamic_table",
           [](Client& c, const std::string& name, const std::string& table) {
             std::vector<int64_t> ids;
             std::vector<float> rows;
             int64_t dim = 0;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.ExportDynamicTable(name, table, &ids, &rows, &dim);
             }
             Check(s);
             const int64_t n = static_cast<int64_t>(ids.size());
             return py::make_tuple(IdsToNumpy(std::move(ids)), ToNumpy(std::move(rows), n, dim));
           })
      .def("import_dynamic_table",
           [](Client& c, const std::string& name, const std::string& table, CArray<int64_t> ids,
              CArray<float> rows) {
             if (ids.ndim() != 1 || rows.ndim() != 2 || rows.shape(0) != ids.shape(0)) {
               throw StatusError{static_cast<int>(absl::StatusCode::kInvalidArgument),
                                 "import_table of a dynamic table takes (ids [n], rows [n, dim])"};
             }
             const int64_t dim = rows.shape(1);
             py::gil_scoped_release release;
             Check(c.ImportDynamicTable(name, table, SpanOf(ids), SpanOf(rows), dim));
           })
      .def("checkpoint",
           [](Client& c, const std::string& name, const std::string& dir, bool incremental) {
             py::gil_scoped_release release;
             return ToJson(Value(c.Checkpoint(name, dir, absl::Minutes(30), incremental)));
           },
           py::arg("name"), py::arg("dir"), py::arg("incremental") = false)
      .def("restore",
           [](Client& c, const std::string& from, const std::string& name,
              const std::string& sharding_type) {
             py::gil_scoped_release release;
             return ToJson(Value(c.Restore(from, name, sharding_type)));
           })
      .def("list_checkpoints",
           [](Client& c, const std::string& name) {
             std::vector<std::string> out;
             py::gil_scoped_release release;
             for (const auto& cp : Value(c.ListCheckpoints(name))) out.push_back(ToJson(cp));
             return out;
           })
      .def("list_restores",
           [](Client& c, const std::string& name) {
             std::vector<std::string> out;
             py::gil_scoped_release release;
             for (const auto& r : Value(c.ListRestores(name))) out.push_back(ToJson(r));
             return out;
           })
      .def("set_trainers",
           [](Client& c, const std::string& name, int32_t trainers, int64_t from_step) {
             absl::StatusOr<ember::v1::CollectionInfo> info;
             {
               py::gil_scoped_release release;
               info = c.SetTrainers(name, trainers, from_step);
             }
             return ToJson(Value(std::move(info)));
           })
      .def("drain_worker", [](Client& c, const std::string& worker_id, double timeout_s) {
        py::gil_scoped_release release;
        return Value(c.DrainWorker(worker_id, absl::Seconds(timeout_s)));
      })
      .def("scale_collection",
           [](Client& c, const std::string& name, int32_t workers, double timeout_s) {
             absl::StatusOr<ember::v1::ScaleCollectionResponse> resp;
             {
               py::gil_scoped_release release;
               resp = c.ScaleCollection(name, workers, absl::Seconds(timeout_s));
             }
             return ToJson(Value(std::move(resp)));
           });
}
