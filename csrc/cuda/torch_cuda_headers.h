#pragma once
// torch's headers that trip GCC's -Winterference-size, included through here (first, before any
// header that includes them): recent torch's CUDAEventPool and host allocator use
// std::hardware_destructive_interference_size, which GCC >= 12 flags in every translation unit
// that includes them. The warning is torch's, not ours; silenced here only.
// ATen/cuda/CUDAEvent.h: at::cuda::CUDAEvent, its own class up to torch 2.10, c10::cuda's from
// 2.11 on (c10/cuda/CUDAEvent.h alone exists only from 2.11).

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#endif
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic pop
#endif
