#pragma once
// Introspection of the transfer resources scatter and gather share: the pinned staging pool and
// peer access between GPUs. In a CPU-only build there is no pool and no peer access.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fastdp {

// (key, value) counters of the pinned pool: capacity, reserved, lent, in_flight, graph_held
// (bytes), graph_returns (blocks given back by destroyed graphs), blocks, allocations, frees,
// waits. Empty in a CPU-only build. See NOTE [ Pinned staging ].
std::vector<std::pair<std::string, int64_t>> pinned_pool_stats();

// Sets the pool capacity in bytes, freeing idle blocks beyond it; returns the previous capacity
// (0 in a CPU-only build, where this does nothing).
int64_t pinned_pool_set_capacity(int64_t bytes);

// Frees every idle pinned block; lent and in-flight blocks stay. No-op in a CPU-only build.
void pinned_pool_empty_cache();

// Whether copies between CUDA devices a and b go peer to peer (decided and verified once per pair;
// FASTDP_P2P=0 says no). a == b is true; false in a CPU-only build.
bool peer_access(int64_t a, int64_t b);

// The window that pipelines a host-staged copy of `total` bytes through a pinned pool of
// `capacity` bytes: all of it when small, else a fixed size under half the capacity so that packing
// one window overlaps the copy of the previous one. 0 when the pool cannot hold any window
// (capacity 0: "staging off"); the caller then copies unstaged. Pure: compiled in every build.
size_t staging_window_for(size_t total, size_t capacity);

// The window of a pageable host-to-GPU scatter of `total` bytes through a pool of `capacity`
// bytes: all of it up to 1 MiB; beyond, half of it clamped to [1 MiB, 4 MiB] (64 KiB steps), so at
// least two windows are in flight and packing one overlaps the DMA of the previous one; never above
// half the capacity. 0 when the pool cannot hold a window (the caller copies unstaged). Pure.
size_t scatter_window_for(size_t total, size_t capacity);

// The window of a GPU-to-GPU copy staged through the host (no usable P2P): staging_window_for when
// that is the whole copy or at least 1 MiB, else 8 MiB (the pool is off or tiny: those windows go
// through pageable memory, one D2H + stream sync + H2D each). Never 0 and never below
// min(total, 1 MiB) whatever the capacity. Used by staged_copy in cuda/peer_access.cpp.
size_t staged_copy_window(size_t total, size_t capacity);

}  // namespace fastdp
