// kernels/abft_cpu.cpp for megatron_abft._emulator, whose bindings call the C++ kernels too
// (their own object file: setup.py's two extensions share one build folder).
#include "kernels/abft_cpu.cpp"
