// The CUDA kernels of abft_cuda.cu built for the CPU through the emulator (cuda_emulator.h), as
// abft::emulated_launchers: what the tests run where there is no GPU.
#include "emulator/cuda_emulator_cuda.h"

#include "kernels/abft_cuda.cu"
