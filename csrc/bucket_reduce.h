#pragma once
// The bucket node of the one reducer, in C++: NOTE [ Early reduction ] in fastdp/_reducer.py.
// Touches no Python object: the bindings wrap the Python callbacks (with the GIL) into `hooks`.

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace fastdp {

struct BucketHooks {
  // Called once per backward of the bucket, first; `local`: two or more replicas, every gradient
  // on the destination (the sum is done here), else `reduce_replicas` sums them (a transport);
  // `fresh`: how many of the local sums go into new tensors (NOTE [ Summing in place ]).
  std::function<void(bool local, int64_t fresh)> on_backward;
  std::function<std::vector<at::Tensor>(const std::vector<std::vector<at::Tensor>>&)>
      reduce_replicas;
};

// Makes the persistent replica tensors of one bucket (`replicas`: replica-major, one run of
// sources.size() tensors per replica) outputs of one autograd node whose backward sums each
// source's replica gradients, in replica order, and hands the sums to the sources' gradient edges
// (AccumulateGrad adds them into .grad). Same-device replicas: one multi-tensor add per replica.
// Returns the outputs (the replica tensors themselves; those of a source that does not require
// grad are not linked). Grad mode must be on.
std::vector<at::Tensor> bucket_reduce_link(const std::vector<at::Tensor>& sources,
                                           const std::vector<at::Tensor>& replicas, at::Device dest,
                                           std::shared_ptr<BucketHooks> hooks);

}  // namespace fastdp
