#include <cuda_runtime.h>

#include <string>

#include "build_info.h"

#ifdef FASTDP_WITH_NCCL
#include <nccl.h>
#endif

namespace fastdp {

std::string cuda_build_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}

std::string nccl_build_version() {
#ifdef FASTDP_WITH_NCCL
  return std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
         std::to_string(NCCL_PATCH);
#else
  return "";
#endif
}

}  // namespace fastdp
