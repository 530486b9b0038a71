// The CUDA emulation on the CPU (tests/cuda_emu/cuda_emu.hpp) in place of the toolkit's header.
#pragma once
#include "../cuda_emu.hpp"
