"""Build script: the checksum kernels in csrc/ as the torch extension ``megatron_abft._C``, and
the test-only ``megatron_abft._emulator``.

ABFT_BUILD picks what is built (default ``auto``):
  auto  the CUDA extension when torch was built with CUDA (true of the CUDA build of torch even
        on a machine without a GPU), else the C++ one;
  cuda  the CUDA extension, or an error;  cpu  the C++ kernels only;  none  no extension (the
        package then runs its PyTorch path).
TORCH_CUDA_ARCH_LIST picks the GPU architectures (default "8.0;9.0"). On x86-64 Linux every build
with an extension also builds ``megatron_abft._emulator``, the CUDA kernels built for the CPU
through the CUDA emulator (csrc/emulator/cuda_emulator.h), which the tests run where there is no
GPU and nothing else imports; ABFT_EMULATOR=0 leaves it out. Build against the torch you run:
``pip install --no-build-isolation --no-deps -e .``.
"""

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup

MODES = ("auto", "cuda", "cpu", "none")
# csrc/: kernels/ (torch-free: C++ and CUDA), bindings/ (torch ops), emulator/ (test-only).
# Sources include each other from here: "kernels/abft.h".
INCLUDE_DIRS = [str(Path(__file__).resolve().parent / "csrc")]
SOURCES = [
    "csrc/bindings/abft_ops.cpp",
    "csrc/bindings/abft_encode.cpp",
    "csrc/bindings/abft_softmax.cpp",
    "csrc/bindings/abft_check.cpp",
    "csrc/bindings/abft_matrix_check.cpp",
    "csrc/bindings/abft_mma_products.cpp",
    "csrc/kernels/abft_cpu.cpp",
]
# The test-only extension: the CUDA kernels (abft_cuda.cu) built by the C++ compiler, the emulator
# that runs them, and the bindings built again to run them on CPU tensors (csrc/emulator/emulated_*:
# each includes its source from csrc/, so that the two extensions' objects do not collide).
EMULATOR_SOURCES = [
    "csrc/emulator/emulator_module.cpp",
    "csrc/emulator/abft_cuda_emulated.cpp",
    "csrc/emulator/cuda_emulator.cpp",
    *(
        f"csrc/emulator/emulated_{name}.cpp"
        for name in (
            "abft_ops",
            "abft_encode",
            "abft_softmax",
            "abft_check",
            "abft_matrix_check",
            "abft_mma_products",
        )
    ),
    "csrc/emulator/emulated_abft_cpu.cpp",
]
# OpenMP: at::parallel_for runs its tasks on torch's threads only where _OPENMP is defined (it
# is serial otherwise). libgomp.so.1 resolves to the copy torch has already loaded.
# -fno-trapping-math lets GCC turn the selects of a loop's body into vector blends (it changes no
# result, only the assumption that a comparison may trap): without it the fused softmax's
# exponential stays scalar.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
LINK_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


def cuda_home() -> str | None:
    """The CUDA toolkit: $CUDA_HOME or $CUDA_PATH, then /usr/local/cuda, then the nvcc on PATH
    with links and wrapper scripts resolved (it may be a script that execs the real nvcc)."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and Path(candidate, "bin", "nvcc").is_file():
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    text = Path(nvcc).read_bytes()[:4096]
    if text.startswith(b"#!"):  # a wrapper: take the first absolute path to an nvcc it names
        for word in text.decode(errors="ignore").split():
            if word.startswith("/") and word.endswith("/bin/nvcc") and Path(word).is_file():
                nvcc = word
                break
    return str(Path(nvcc).resolve().parent.parent)


def nvidia_wheel_dirs(kind: str) -> list[str]:
    """include/ or lib/ folders of the nvidia-* runtime wheels beside torch (cuBLAS and cuSPARSE
    headers that a pip-assembled toolkit may lack)."""
    found = []
    for site in sys.path:
        root = Path(site, "nvidia")
        if root.is_dir():
            found += sorted(str(p) for p in root.glob(f"*/{kind}") if p.is_dir())
    return found


def emulator(cpp_extension) -> list:
    """The test-only emulator extension, where it is built (its fibers switch stacks in x86-64
    assembly, and ABFT_EMULATOR is not 0), else none."""
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return []
    if os.environ.get("ABFT_EMULATOR", "1").strip() == "0":
        return []
    ext = cpp_extension.CppExtension(
        "megatron_abft._emulator",
        EMULATOR_SOURCES,
        include_dirs=INCLUDE_DIRS,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )
    return [ext]


def extensions() -> tuple[list, dict]:
    mode = os.environ.get("ABFT_BUILD", "auto").strip().lower()
    if mode not in MODES:
        raise SystemExit(f"ABFT_BUILD={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return [], {}
    home = cuda_home()
    if home is not None:  # before torch.utils.cpp_extension reads it at import
        os.environ["CUDA_HOME"] = home
    import torch
    from torch.utils import cpp_extension

    use_cuda = mode == "cuda" or (mode == "auto" and torch.version.cuda is not None)
    if use_cuda and torch.version.cuda is None:
        raise SystemExit(f"ABFT_BUILD=cuda, but torch {torch.__version__} was built without CUDA")
    if use_cuda and home is None:
        raise SystemExit(
            f"ABFT_BUILD={mode} found no CUDA toolkit: set CUDA_HOME or ABFT_BUILD=cpu"
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    emulated = emulator(cpp_extension)
    if not use_cuda:
        ext = cpp_extension.CppExtension(
            "megatron_abft._C",
            SOURCES,
            include_dirs=INCLUDE_DIRS,
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=LINK_FLAGS,
        )
        return [ext, *emulated], {"build_ext": build_ext}

    cpp_extension.CUDA_HOME = home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # after every -I and system folder, so that the toolkit's own CUDA headers win
    wheel_includes = [flag for d in nvidia_wheel_dirs("include") for flag in ("-idirafter", d)]
    ext = cpp_extension.CUDAExtension(
        "megatron_abft._C",
        [*SOURCES, "csrc/kernels/abft_cuda.cu"],
        include_dirs=INCLUDE_DIRS,
        define_macros=[("ABFT_WITH_CUDA", None)],
        library_dirs=nvidia_wheel_dirs("lib"),
        extra_compile_args={"cxx": CXX_FLAGS + wheel_includes, "nvcc": NVCC_FLAGS},
        extra_link_args=LINK_FLAGS,
    )
    return [ext, *emulated], {"build_ext": build_ext}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
