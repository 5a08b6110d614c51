"""Repository rule that detects the CUDA toolkit.

Creates a repository with:
  defs.bzl   CUDA_AVAILABLE (bool) and CUDA_PATH (string)
  BUILD      :cuda_headers and :cudart_static (only when CUDA is available)

The toolkit is looked for at $CUDA_PATH, then /usr/local/cuda. When nvcc is
missing the CUDA targets are simply not defined and the CPU-only build goes on.
Bazel 4 rejects nested functions in .bzl files, so every def is top-level.
"""

def _find_cuda(repository_ctx):
    candidates = []
    env_path = repository_ctx.os.environ.get("CUDA_PATH", "")
    if env_path:
        candidates.append(env_path)
    candidates.append("/usr/local/cuda")
    for path in candidates:
        if repository_ctx.path(path + "/bin/nvcc").exists:
            return path
    return ""

def _cuda_configure_impl(repository_ctx):
    cuda_path = _find_cuda(repository_ctx)
    if repository_ctx.os.environ.get("EMBER_DISABLE_CUDA", "") == "1":
        cuda_path = ""
    available = cuda_path != ""
    repository_ctx.file("defs.bzl", "CUDA_AVAILABLE = %s\nCUDA_PATH = %r\n" % (available, cuda_path))
    if not available:
        repository_ctx.file("BUILD", "# CUDA toolkit not found: no CUDA targets.\nexports_files([\"defs.bzl\"])\n")
        return
    repository_ctx.symlink(cuda_path + "/include", "include")
    repository_ctx.symlink(cuda_path + "/lib64", "lib64")
    repository_ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

# Every header of the toolkit (<nv/target> has no extension).
filegroup(
    name = "all_headers",
    srcs = glob(["include/**"]),
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

# Static cudart, so binaries need nothing on a GPU machine but the driver.
cc_library(
    name = "cudart_static",
    srcs = ["lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "EMBER_DISABLE_CUDA"],
    local = True,
)
