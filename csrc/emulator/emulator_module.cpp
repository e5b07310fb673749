// megatron_abft._emulator, a test-only extension: the CUDA kernels of abft_cuda.cu built for the
// CPU through the CUDA emulator (abft_cuda_emulated.cpp, cuda_emulator.cpp), handed to _C as an
// abft::Emulator (_C.emulate_cuda) by megatron_abft.ops.compiled.emulated_cuda(). Production builds
// can leave it out (ABFT_EMULATOR=0): nothing but that context imports it.
#include <Python.h>

#include "kernels/abft.h"
#include "emulator/cuda_emulator.h"

namespace {

const abft::Emulator kEmulator{&abft::emulated_launchers, cuda_emulator::forget_errors,
                               cuda_emulator::last_message, cuda_emulator::set_schedule};

// _emulator.table() -> a capsule of the abft::Emulator, for _C.emulate_cuda.
PyObject* table(PyObject*, PyObject*) {
  return PyCapsule_New(const_cast<abft::Emulator*>(&kEmulator), "megatron_abft._emulator.table",
                       nullptr);
}

PyMethodDef methods[] = {
    {"table", table, METH_NOARGS, "table() -> the emulated CUDA kernels, for _C.emulate_cuda"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__emulator(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_emulator", "megatron-abft's CUDA kernels on the CPU (tests)", -1,
      methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
