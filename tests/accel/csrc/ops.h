// The test device's ops: allocation, copies, resizes and storage swaps, and the CPU fallback
// for every other op. Included by accel.cpp only.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>

#include "runtime.h"

namespace fdpaccel {

inline bool on_device(const at::Tensor& t) { return t.device().type() == kType; }

inline c10::DeviceIndex target_index(std::optional<c10::Device> device) {
  TORCH_CHECK(!device || device->type() == kType, "fdpaccel: expected a device of this type, got ",
              *device);
  const c10::DeviceIndex i = resolve(device ? device->index() : -1);
  check_index(i, "empty");
  return i;
}

inline at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout, std::optional<c10::Device> device,
                 std::optional<bool> /*pin_memory*/, std::optional<at::MemoryFormat> format) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "fdpaccel empty: strided layout only");
  return at::detail::empty_generic(size, allocator(target_index(device)),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

inline at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "fdpaccel empty_strided: strided layout only");
  return at::detail::empty_strided_generic(size, stride, allocator(target_index(device)),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Copies as CUDA orders them: host<->device on the device's current stream, blocking unless
// non_blocking with pinned host memory (a pageable source is read at once, a pageable destination
// waits); device<->device always asynchronous, on the source's current stream, after the
// destination's current stream and before its later work.
inline at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  if (dst.numel() == 0) return dst;
  Locked g;
  if (on_device(src) && on_device(dst)) {
    StreamState& from = current_state(src.device().index());
    StreamState& to = current_state(dst.device().index());
    at::Tensor s = host_view(src), d = host_view(dst);
    wait_for(from, to, to.enqueued);
    enqueue(from, [s, d]() mutable { d.copy_(s); });
    wait_for(to, from, from.enqueued);
  } else if (on_device(dst)) {
    TORCH_CHECK(src.is_cpu(), "fdpaccel copy: expected a CPU source, got ", src.device());
    StreamState& to = current_state(dst.device().index());
    const bool pinned = src.numel() == 0 || is_pinned(src.storage().data());
    at::Tensor s = pinned ? src : src.clone(), d = host_view(dst);
    const int64_t pos = enqueue(to, [s, d]() mutable { d.copy_(s); });
    if (!non_blocking) drain_to(to, pos);
  } else {
    TORCH_CHECK(dst.is_cpu(), "fdpaccel copy: expected a CPU destination, got ", dst.device());
    StreamState& from = current_state(src.device().index());
    at::Tensor s = host_view(src), d = dst;
    const int64_t pos = enqueue(from, [s, d]() mutable { d.copy_(s); });
    if (!non_blocking || !is_pinned(dst.storage().data())) drain_to(from, pos);
  }
  return dst;
}

inline const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format) impl->empty_tensor_restride(*format);
  const size_t need = at::detail::computeStorageNbytes(size, self.strides(), self.itemsize(),
                                                       self.storage_offset());
  if (need > self.storage().nbytes()) resize_storage_bytes(self.storage(), need);
  return self;
}

inline at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.sizes() != src.sizes()) {
    if (on_device(dst)) {
      resize_(dst, src.sizes(), std::nullopt);
    } else {
      dst.resize_(src.sizes());
    }
  }
  return copy_from(src, dst, false);
}

inline at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device() == self.device(), "fdpaccel set_: storage on ", source.device(),
              ", tensor on ", self.device());
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  const size_t need =
      at::detail::computeStorageNbytes(size, self.strides(), self.itemsize(), offset);
  if (need > self.storage().nbytes()) resize_storage_bytes(self.storage(), need);
  return self;
}

inline at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / self.itemsize();
  return set_storage(self, std::move(source), 0, {n}, {});
}

inline at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

inline at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty_storage(c10::Storage::use_byte_size_t(), 0,
                             allocator(self.device().index()), true);
  return set_storage(self, std::move(empty_storage), 0, {0}, {});
}

// Checks the devices of an op's tensors as CUDA's kernels do (the _foreach_ ops run per tensor,
// through torch's composite kernels): one device per op. Returns the device the op runs on.
inline std::optional<c10::Device> op_device(const c10::OperatorHandle& op,
                                            torch::jit::Stack* stack) {
  std::optional<c10::Device> first;
  auto seen = [&](const at::Tensor& t) {
    if (!t.defined() || !on_device(t)) return;
    if (!first) first = t.device();
    TORCH_CHECK(*first == t.device(), "Expected all tensors to be on the same device, but found "
                "at least two devices, ", *first, " and ", t.device(),
                "! (when checking arguments for ", op.schema().name(), ")");
  };
  for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size())) {
    if (v.isTensor()) {
      seen(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) seen(t);
    } else if (v.isOptionalTensorList()) {
      const auto list = v.toOptionalTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        const std::optional<at::Tensor> t = list.get(i);
        if (t) seen(*t);
      }
    }
  }
  return first;
}

// Every op without a kernel here runs on the host: its tensors are copied to the CPU (draining
// their device's current stream), the CPU kernel runs, and results go back to the op's device.
// View ops must have a kernel here (error_on_views): a host copy is not a view.
inline void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::optional<c10::Device> device = op_device(op, stack);
  c10::OptionalDeviceGuard on(device);
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

// Convolutions reach a backend outside torch's own as the *_overrideable ops, which have no CPU
// kernel for the fallback to call: they run here on host copies through torch's CPU convolution.
inline at::Tensor host(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device() == like.device(), "Expected all tensors to be on the same device, but ",
              "found at least two devices, ", like.device(), " and ", t.device(), " (", what, ")");
  return t.cpu();
}

inline at::Tensor back(const at::Tensor& t, c10::Device device) {
  return t.defined() ? t.to(device) : t;
}

inline at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                              at::IntArrayRef output_padding, int64_t groups) {
  c10::DeviceGuard on(input.device());
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) b = host(*bias, input, "convolution bias");
  return back(at::convolution(input.cpu(), host(weight, input, "convolution weight"), b, stride,
                              padding, dilation, transposed, output_padding, groups),
              input.device());
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  c10::DeviceGuard on(input.device());
  const std::vector<int64_t> bias_sizes{weight.size(transposed ? 1 : 0) * (transposed ? groups : 1)};
  auto [gi, gw, gb] = at::convolution_backward(
      host(grad_output, input, "convolution grad"), input.cpu(),
      host(weight, input, "convolution weight"), bias_sizes, stride, padding, dilation,
      transposed, output_padding, groups, output_mask);
  return {back(gi, input.device()), back(gw, input.device()), back(gb, input.device())};
}

// native_batch_norm writes the running statistics without declaring them mutable in its schema,
// so the fallback would not copy them back: it runs here, on host copies written back.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps) {
  c10::DeviceGuard on(input.device());
  auto opt = [&](const std::optional<at::Tensor>& t, const char* what) {
    return t && t->defined() ? std::optional<at::Tensor>(host(*t, input, what)) : std::nullopt;
  };
  std::optional<at::Tensor> mean = opt(running_mean, "running_mean");
  std::optional<at::Tensor> var = opt(running_var, "running_var");
  auto [out, save_mean, save_invstd] = at::native_batch_norm(
      input.cpu(), opt(weight, "weight"), opt(bias, "bias"), mean, var, training, momentum, eps);
  if (training && mean) running_mean->copy_(*mean);
  if (training && var) running_var->copy_(*var);
  return {back(out, input.device()), back(save_mean, input.device()),
          back(save_invstd, input.device())};
}

// The fused RNN cells torch calls for any device but the CPU have kernels for CUDA only: here
// they are composites of differentiable ops (registered for autograd, which records those ops).
inline at::Tensor gates(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? gates + *bias : gates;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const at::Tensor all = gates(input_gates, input_bias) + gates(hidden_gates, hidden_bias);
  const std::vector<at::Tensor> c = all.chunk(4, 1);
  const at::Tensor cy = c[1].sigmoid() * cx + c[0].sigmoid() * c[2].tanh();
  return {c[3].sigmoid() * cy.tanh(), cy, all};
}

inline std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const std::vector<at::Tensor> i = gates(input_gates, input_bias).chunk(3, 1);
  const std::vector<at::Tensor> h = gates(hidden_gates, hidden_bias).chunk(3, 1);
  const at::Tensor reset = (h[0] + i[0]).sigmoid(), update = (h[1] + i[1]).sigmoid();
  const at::Tensor fresh = (i[2] + h[2] * reset).tanh();
  return {(hx - fresh) * update + fresh, reset};
}

}  // namespace fdpaccel
