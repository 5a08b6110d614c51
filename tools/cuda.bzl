"""ember_cuda_library: compiles .cu files with nvcc into a static archive.

No rules_cuda under offline Bazel 4: a genrule runs nvcc (-c per file, then
`ar rcs`), and a cc_library wraps the archive with alwayslink so kernels and
their host wrappers are kept. Only call this where CUDA_AVAILABLE is true
(load it from @local_cuda//:defs.bzl).
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH")

NVCC_FLAGS = [
    "-ccbin /usr/bin/g++",
    "-std=c++17",
    "-O3",
    "-Xcompiler -fPIC",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def ember_cuda_library(name, srcs, hdrs = [], cu_hdrs = [], deps = [], visibility = None):
    """A cc_library `name` holding the nvcc-compiled `srcs`.

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: host headers exported to C++ users (no CUDA types in them).
      cu_hdrs: every other header the .cu files include (the genrule sandbox
        sees only listed files).
      deps: C++ dependencies of the users.
      visibility: visibility of the library.
    """
    archive = "lib" + name + "_cu.a"
    objs = [s[:-len(".cu")] + ".cu.o" for s in srcs]
    pkg = native.package_name()
    compile_cmds = []
    for src, obj in zip(srcs, objs):
        compile_cmds.append(
            "%s/bin/nvcc %s -I. -c %s/%s -o $(@D)/%s" %
            (CUDA_PATH, " ".join(NVCC_FLAGS), pkg, src, obj),
        )
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs + cu_hdrs + ["@local_cuda//:all_headers"],
        outs = [archive],
        cmd = " && ".join(compile_cmds) + " && ar rcs $@ " +
              " ".join(["$(@D)/" + o for o in objs]),
    )
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        alwayslink = True,
        linkopts = ["-ldl", "-lpthread", "-lrt"],
        deps = deps + ["@local_cuda//:cudart_static"],
        visibility = visibility,
    )
