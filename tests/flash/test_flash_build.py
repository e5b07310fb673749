"""The kernel modules as their CUDA launches take them (megatron_abft.flash.build.compiled):
Triton's launcher would compare each constexpr global a kernel reads at every launch; the
kernels are hashed as Triton hashes them, those globals' values included, and hold none to
compare."""

import importlib.util
import sys

import pytest
from triton.runtime.jit import JITFunction

from megatron_abft.flash import build, checksums, kernels
from megatron_abft.ops import checked_gemm


def _launched(module) -> dict[str, JITFunction]:
    return {
        name: member
        for name, member in vars(module).items()
        if name.endswith("_kernel") and isinstance(member, JITFunction)
    }


def _fresh(module):
    """``module`` loaded again from its file, its kernels as Triton leaves them."""
    name = module.__name__ + "_fresh"
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    try:
        spec.loader.exec_module(loaded)
    finally:
        del sys.modules[name]
    return loaded


@pytest.mark.parametrize("module", [kernels, checksums, checked_gemm], ids=lambda m: m.__name__)
def test_launched_kernels_keep_their_globals_in_their_keys_and_none_to_compare(module):
    fresh = _launched(_fresh(module))
    keys = {name: kernel.cache_key for name, kernel in fresh.items()}
    assert any(kernel.used_global_vals for kernel in fresh.values())  # what Triton compares
    launched = _launched(build.compiled(module))
    assert launched.keys() == keys.keys() and len(keys) >= 3
    for name, kernel in launched.items():
        assert kernel.used_global_vals == {}, name
        assert kernel.cache_key == keys[name], name
