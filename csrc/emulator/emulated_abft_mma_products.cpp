// bindings/abft_mma_products.cpp built again for megatron_abft._emulator (bindings/abft_binding.h).
#define ABFT_EMULATED 1
#include "bindings/abft_mma_products.cpp"
