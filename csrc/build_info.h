#pragma once
// What this extension was built with, for fastdp.info().

#include <string>
#include <utility>
#include <vector>

namespace fastdp {

// Key/value pairs: version, built_with_cuda, cuda_version, arch_list, nccl_version.
// Values are strings ("" when not applicable); stable for the lifetime of the process.
std::vector<std::pair<std::string, std::string>> build_info();

#ifdef WITH_CUDA
// CUDA runtime version the CUDA sources were compiled against (CUDART_VERSION), e.g. "13.0".
std::string cuda_build_version();
// NCCL version compiled in, "" when built without NCCL.
std::string nccl_build_version();
#endif

}  // namespace fastdp
