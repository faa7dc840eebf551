#pragma once
// ATen/cuda/CUDAEvent.h (at::cuda::CUDAEvent: its own class up to torch 2.10, c10::cuda's from
// 2.11 on; c10/cuda/CUDAEvent.h alone exists only from 2.11), included through here: recent
// torch's CUDAEventPool uses std::hardware_destructive_interference_size, which GCC >= 12 flags
// with -Winterference-size in every translation unit that includes it. The warning is torch's,
// not ours; silence it locally.

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <ATen/cuda/CUDAEvent.h>
#pragma GCC diagnostic pop
#else
#include <ATen/cuda/CUDAEvent.h>
#endif
