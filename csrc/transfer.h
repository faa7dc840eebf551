#pragma once
// Introspection of the transfer resources scatter and gather share: the pinned staging pool and
// peer access between GPUs. In a CPU-only build there is no pool and no peer access.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fastdp {

// (key, value) counters of the pinned pool: capacity, reserved, lent, in_flight (bytes), blocks,
// allocations. Empty in a CPU-only build. See NOTE [ Pinned staging ].
std::vector<std::pair<std::string, int64_t>> pinned_pool_stats();

// Sets the pool capacity in bytes, freeing idle blocks beyond it; returns the previous capacity
// (0 in a CPU-only build, where this does nothing).
int64_t pinned_pool_set_capacity(int64_t bytes);

// Frees every idle pinned block; lent and in-flight blocks stay. No-op in a CPU-only build.
void pinned_pool_empty_cache();

// Whether copies between CUDA devices a and b go peer to peer (decided and verified once per pair;
// FASTDP_P2P=0 says no). a == b is true; false in a CPU-only build.
bool peer_access(int64_t a, int64_t b);

}  // namespace fastdp
