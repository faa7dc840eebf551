#pragma once
// c10/cuda/CUDAEvent.h, included through here: its CUDAEventPool uses
// std::hardware_destructive_interference_size, which GCC >= 12 flags with -Winterference-size in
// every translation unit that includes it. The warning is torch's, not ours; silence it locally.

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <c10/cuda/CUDAEvent.h>
#pragma GCC diagnostic pop
#else
#include <c10/cuda/CUDAEvent.h>
#endif
