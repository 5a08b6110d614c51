"""C++ code generation for .proto files with the system protoc and gRPC plugin.

proto_library/cc_proto_library want downloads under Bazel 4, so this is a
genrule around /usr/bin/protoc wrapped in a cc_library.
"""

def ember_cc_proto(name, srcs, deps = [], grpc = False, visibility = None):
    """Generates a cc_library `name` from `srcs` (.proto files in this package).

    Args:
      name: target name of the resulting cc_library.
      srcs: .proto files, in this package.
      deps: other ember_cc_proto targets whose .proto files are imported.
      grpc: also generate gRPC service stubs (*.grpc.pb.{h,cc}).
      visibility: visibility of the cc_library.
    """
    outs = []
    hdrs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
        hdrs.append(base + ".pb.h")
        if grpc:
            outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
            hdrs.append(base + ".grpc.pb.h")
    pkg = native.package_name()
    grpc_flags = ""
    tools = []
    if grpc:
        grpc_flags = "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin --grpc_out=$(GENDIR) "
    native.genrule(
        name = name + "_codegen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = ("/usr/bin/protoc --proto_path=. --cpp_out=$(GENDIR) " + grpc_flags +
               " ".join([pkg + "/" + s for s in srcs])),
        tools = tools,
    )
    native.filegroup(
        name = name + "_srcs",
        srcs = srcs,
        visibility = visibility,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = hdrs,
        deps = ["//third_party:protobuf"] + (["//third_party:grpc"] if grpc else []) + deps,
        visibility = visibility,
    )
