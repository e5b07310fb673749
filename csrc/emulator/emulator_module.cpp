// megatron_abft._emulator, a test-only extension: the CUDA kernels of abft_cuda.cu built for the
// CPU through the CUDA emulator (abft_cuda_emulated.cpp, cuda_emulator.cpp), and the bindings
// (csrc/bindings, built with ABFT_EMULATED) that run them on CPU tensors. Importing it registers
// nothing; emulate(True) registers those bindings over _C's kernels for CPU tensors and over its
// composites, until emulate(False), for megatron_abft.ops.compiled.emulated_cuda(). Production
// builds can leave it out (ABFT_EMULATOR=0), and nothing but that context imports it.
#define ABFT_EMULATED 1

#include <Python.h>

#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/abft_binding.h"
#include "emulator/cuda_emulator.h"

namespace abft_binding {

std::vector<Registration>& emulated_registrations(c10::DispatchKey key) {
  static std::vector<Registration> cpu, composite;
  return key == c10::DispatchKey::CPU ? cpu : composite;
}

bool emulate(bool on) {
  // Registered while they live: dropping them puts _C's kernels back.
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  const bool was = !libraries.empty();
  if (on == was) return was;
  if (!on) {
    libraries.clear();
    return was;
  }
  for (const auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CompositeImplicitAutograd}) {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "megatron_abft", key,
                                                    __FILE__, __LINE__);
    for (const Registration registration : emulated_registrations(key)) {
      registration(*library);
    }
    libraries.push_back(std::move(library));
  }
  return was;
}

}  // namespace abft_binding

namespace {

// _emulator.emulate(on, schedule) -> (on, schedule) before: whether the ops on CPU tensors run
// the CUDA kernels through the emulator, and its schedule (cuda_emulator::set_schedule).
PyObject* emulate(PyObject*, PyObject* args) {
  int on = 0;
  long long schedule = 0;
  if (!PyArg_ParseTuple(args, "pL", &on, &schedule)) return nullptr;
  bool was = false;
  std::string error;
  try {
    was = abft_binding::emulate(on != 0);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  const long long previous = cuda_emulator::set_schedule(schedule);
  return Py_BuildValue("(OL)", was ? Py_True : Py_False, previous);
}

// _emulator.launches() -> [str]: the kernels launched since the last call, as their launches
// name them (cuda_emulator::take_launches).
PyObject* launches(PyObject*, PyObject*) {
  const std::vector<std::string> names = cuda_emulator::take_launches();
  PyObject* list = PyList_New(Py_ssize_t(names.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* name = PyUnicode_FromString(names[i].c_str());
    if (name == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, Py_ssize_t(i), name);
  }
  return list;
}

PyMethodDef methods[] = {
    {"emulate", emulate, METH_VARARGS,
     "emulate(on, schedule) -> (on, schedule) before: run the CUDA kernels on CPU tensors, "
     "through the emulator, in that schedule"},
    {"launches", launches, METH_NOARGS,
     "launches() -> [str]: the kernels launched since the last call, in order"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__emulator(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_emulator", "megatron-abft's CUDA kernels on the CPU (tests)", -1,
      methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
