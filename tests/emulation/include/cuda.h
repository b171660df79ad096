// Stand-in for CUDA's <cuda.h> under the CPU emulation: everything lives in cuda_emu.h.
#pragma once
#include "../cuda_emu.h"
