"""Triton kernels compiled for CUDA tensors and interpreted for CPU tensors, from the same
source, with nothing for the user to set.

The interpreter is a second load of a kernels module with Triton's interpret switch on while
it is decorated: ``triton.jit`` picks compiled or interpreted functions at decoration time, and
a kernel's helpers resolve through its module, so each build needs its own module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from types import ModuleType

import numpy as np
import torch
import triton


def _patch_interpreter(interpreter: ModuleType) -> None:
    """Fixes to Triton 3.6's interpreter for kernels interpreted in a process that also
    compiles, applied within each interpreted launch (its own patch scope, undone after):

    - triton.language's library functions (tl.sum, tl.max, tl.cdiv...) were decorated for the
      compiler when triton was imported: they run as interpreted functions instead;
    - those functions patch triton.language.core each time they are called, in a scope the
      interpreter never undoes, which broke the next compilation (a cast resolved to the
      interpreter's): the launch's own scope patches core first, so that it undoes theirs;
    - its tensors serve as ``range`` bounds under numpy >= 2.4, which refuses ``int()`` of a
      one-element array (triton-lang/triton#9171): every scalar in the interpreter is one;
    - a function called inside a launch (a kernel's helpers, tl.sum) skips patching the language
      again, which the launch has done: a third of the kernels' time in the interpreter went to
      it;
    - its ``tl.fma`` rounds the product and then the sum: it rounds once, as a GPU's FMA does
      (the exact fp32 product in fp64, then the sum, rounded to fp32: two roundings, which
      differ from one only at rare ties);
    - its numpy type of a Triton type builds a table of every type at each of its calls, a
      tenth of a flash call's time in the interpreter: the same answers from a table made once
      (from the function itself), by the type's name;
    - every tensor it makes types its shape's tuple and formats the names of that type and of
      its block type, which a launch hardly reads: within a launch they are made when read
      (_lazy_types).
    """
    original = interpreter._patch_lang_tensor
    if getattr(original, "abft_fixes", False):
        return
    import triton.experimental.gluon  # noqa: F401  imported on the first launch: before the patch
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    library = [
        (module, name, member)
        for module in (tl, tl.standard)
        for name, member in vars(module).items()
        if isinstance(member, JITFunction)
    ]
    interpreted = {
        id(member): interpreter.InterpretedFunction(member.fn) for _, _, member in library
    }

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        for module, name, member in library:
            scope.set_attr(module, name, interpreted[id(member)])
        interpreter._patch_builtin(tl.core, interpreter.interpreter_builder, scope)
        interpreter._patch_lang_core(tl.core, scope)
        for cls, init in lazy_types:
            scope.set_attr(cls, "__init__", init)

    lazy_types = _lazy_types(tl.core)
    patch.abft_fixes = True
    interpreter._patch_lang_tensor = patch

    launching = interpreter.GridExecutor.__call__
    calling = interpreter.InterpretedFunction.__call__
    inside = [0]  # launches running: their scope holds every patch a call would make

    def launch(self, *args, **kwargs):
        inside[0] += 1
        try:
            return launching(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    def call(self, *args, **kwargs):
        if not inside[0]:
            return calling(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    def fused_multiply_add(self, x, y, z):
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data
        return interpreter.TensorHandle(exact.astype(z.data.dtype), z.dtype.scalar)

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call
    interpreter.InterpreterBuilder.create_fma = fused_multiply_add
    interpreter._get_np_dtype = _numpy_types(interpreter._get_np_dtype)


@functools.cache
def _lazy_types(core: ModuleType) -> list[tuple[type, object]]:
    """Gives Triton's tuple and block types a ``name``, and its tuples a ``type``, made when
    first read (properties, whose setters keep what is given, as Triton's own constructors
    give it), and returns constructors that give none, for the interpreter's launches: Triton
    3.6's own, but for those. Outside a launch they are made as before (the compiler changes a
    tuple type's types after making it, so its name must be the one made first)."""

    def made_when_read(cls, attribute, make):
        key = "_abft_" + attribute

        def get(self):
            value = self.__dict__.get(key)
            if value is None:
                value = self.__dict__[key] = make(self)
            return value

        def put(self, value):
            self.__dict__[key] = value

        setattr(cls, attribute, property(get, put))

    def tuple_name(t):
        fields = ",".join(f"{k}:{v}" for k, v in zip(t.fields, t.types, strict=False))
        return f"[{fields}]"

    made_when_read(core.tuple_type, "name", tuple_name)
    made_when_read(core.block_type, "name", lambda t: f"<{t.shape}, {t.element_ty}>")
    made_when_read(core.tuple, "type", lambda t: core._type_for_tuple_values(t.values))

    def make_tuple_type(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def make_block_type(self, element_ty, shape):
        self.element_ty = element_ty
        assert isinstance(shape, list | core.tuple)  # Triton's tuple, as its own
        self.shape = core.tuple(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError("0d block_type is forbidden")
        self.numel = core.validate_block_shape(self.shape)

    def make_tuple(self, args, type=None):
        self.values = list(args)
        if isinstance(type, core.tuple_type):
            self.type = type
        elif type is not None:
            self.type = core.tuple_type(type)

    return [
        (core.tuple_type, make_tuple_type),
        (core.block_type, make_block_type),
        (core.tuple, make_tuple),
    ]


def _numpy_types(original):
    """``original`` (the interpreter's numpy type of a Triton type, of a block's elements, or of
    a pointer) answered from a table of every scalar type's answer, by name."""
    import triton.language as tl

    table = {}
    for member in vars(tl.core).values():
        if isinstance(member, tl.dtype) and not isinstance(member, tl.pointer_type | tl.block_type):
            with contextlib.suppress(KeyError):  # a type the interpreter has no numpy type for
                table[member.name] = original(member)
    pointer = np.dtype(np.uint64)

    def numpy_type(of):
        element = of.element_ty if isinstance(of, tl.block_type) else of
        if isinstance(element, tl.pointer_type):
            return pointer
        found = table.get(element.name)
        return found if found is not None else original(of)

    numpy_type.original = original
    return numpy_type


@contextlib.contextmanager
def _interpreting():
    """Triton's interpret switch on, and its environment variable as it was after."""
    before = os.environ.get("TRITON_INTERPRET")
    triton.knobs.runtime.interpret = True
    try:
        yield
    finally:
        del triton.knobs.runtime.interpret
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@functools.cache
def interpreted(module: ModuleType) -> ModuleType:
    """``module`` loaded again, its kernels decorated for the interpreter, and its
    ``INTERPRETER`` constexpr, where it has one, True."""
    from triton.runtime import interpreter

    _patch_interpreter(interpreter)
    name = module.__name__ + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    loaded = importlib.util.module_from_spec(spec)
    with _interpreting():
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    if hasattr(loaded, "INTERPRETER"):  # the kernels' switch for the interpreter's differences
        import triton.language as tl

        loaded.INTERPRETER = tl.constexpr(True)
    return loaded


@functools.cache
def compiled(module: ModuleType) -> ModuleType:
    """``module`` with its kernels (its JIT functions named ``*_kernel``, the ones launched)
    ready to launch lightly: Triton's launcher compares, at every launch, each constexpr global
    a kernel and its helpers read with its value when the kernel was first hashed (about 1 us
    apiece on the host, 21 globals for dK/dV), to refuse a global changed since. The modules'
    constants are set once, at import, and their values are already in each kernel's cache
    key, which is made here: the comparison is left out."""
    from triton.runtime.jit import JITFunction

    for name, member in vars(module).items():
        if name.endswith("_kernel") and isinstance(member, JITFunction):
            member.cache_key  # noqa: B018  hashes the kernel, the globals' values included
            member.used_global_vals = {}
    return module


def for_device(module: ModuleType, device: torch.device) -> ModuleType:
    """``module``'s kernels that run on ``device``: compiled on CUDA, interpreted on CPU."""
    if device.type == "cuda":
        return compiled(module)
    if device.type == "cpu":
        return interpreted(module)
    raise ValueError(f"the flash kernels run on CUDA or CPU tensors, not {device.type}")
