#include "build_info.h"

namespace fastdp {

std::vector<std::pair<std::string, std::string>> build_info() {
  std::vector<std::pair<std::string, std::string>> info = {{"version", FASTDP_VERSION}};
#ifdef WITH_CUDA
  info.emplace_back("built_with_cuda", "1");
  info.emplace_back("cuda_version", cuda_build_version());
  info.emplace_back("arch_list", FASTDP_ARCH_LIST);
  info.emplace_back("nccl_version", nccl_build_version());
#else
  info.emplace_back("built_with_cuda", "0");
  info.emplace_back("cuda_version", "");
  info.emplace_back("arch_list", "");
  info.emplace_back("nccl_version", "");
#endif
  return info;
}

}  // namespace fastdp
