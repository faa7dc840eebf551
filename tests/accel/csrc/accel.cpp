// A multi-device test accelerator on torch's PrivateUse1 extension points: the device guard
// (devices, streams, events), the hooks and the op registrations (ops.h holds the kernels,
// runtime.h the devices, streams and memory). Built by tests/accel/__init__.py.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "ops.h"
#include "runtime.h"

namespace fdpaccel {
namespace {

EventState* event_of(void* event) { return static_cast<EventState*>(event); }

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_device()}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "fdpaccel setDevice: expected a device of this type, got ", d);
    check_index(d.index(), "setDevice");
    current_device() = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_device() = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    const c10::DeviceIndex i = resolve(d.index());
    check_index(i, "getStream");
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), current_streams()[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, resolve(d.index())), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    static std::atomic<c10::StreamId> next{0};
    const c10::StreamId id = 1 + next++ % kPoolSize;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, resolve(d.index())), id);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    static std::atomic<c10::StreamId> next{kFirstNewStream};
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, resolve(d.index())), next++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    check_index(s.device_index(), "exchangeStream");
    c10::StreamId& slot = current_streams()[s.device_index()];
    const c10::StreamId old = slot;
    slot = s.id();
    return c10::Stream(c10::Stream::UNSAFE, s.device(), old);
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(devices().load());
  }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(index == -1 || index == s.device_index(), "fdpaccel record: event of device ",
                int(index), " recorded on a stream of device ", int(s.device_index()));
    Locked g;
    if (*event == nullptr) *event = new EventState();
    StreamState& state = stream_state(s);
    event_of(*event)->stream = &state;
    event_of(*event)->pos = state.enqueued;
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event == nullptr) return;
    Locked g;
    EventState* e = event_of(event);
    if (e->stream != nullptr) wait_for(stream_state(s), *e->stream, e->pos);
  }
  bool queryEvent(void* event) const override {
    synchronizeEvent(event);
    return true;
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    Locked g;
    EventState* e = event_of(event);
    if (e->stream != nullptr) drain_to(*e->stream, e->pos);
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    delete event_of(event);
  }
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override {
    TORCH_CHECK(false, "fdpaccel: events do not time (elapsed_time is not supported)");
  }
  bool queryStream(const c10::Stream& s) const override {
    synchronizeStream(s);
    return true;
  }
  void synchronizeStream(const c10::Stream& s) const override { drain(stream_state(s)); }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    synchronize_device(resolve(index));
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

const GuardImpl& guard() {
  static auto* impl = new GuardImpl();
  return *impl;
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return devices().load() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return guard().deviceCount(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { guard().setDevice({kType, d}); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    return guard().exchangeDevice({kType, d}).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  c10::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> g(blocks().m);
    auto it = blocks().live.find(data);
    TORCH_CHECK(it != blocks().live.end(), "fdpaccel: ", data,
                " is not the start of device memory");
    return {kType, it->second.second};
  }
  // Random ops run on the host through the fallback, with the CPU's generator.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage, nbytes);
  }
};

void configure(int64_t count, bool async_mode) {
  TORCH_CHECK(count >= 1 && count <= kMaxDevices, "fdpaccel configure: 1 <= devices <= ",
              kMaxDevices, ", got ", count);
  const int now = devices().load();
  TORCH_CHECK(now == 0 || now == count, "fdpaccel configure: the device count is fixed at ", now,
              " for the process (autograd starts one thread per device), got ", count);
  synchronize_device(-1);
  asynchronous().store(async_mode);
  if (now == 0) {
    devices().store(static_cast<int>(count));
    c10::SetAllocator(kType, allocator(-1));
    at::RegisterPrivateUse1HooksInterface(new Hooks());  // leaked: torch keeps the pointer
  }
}

int64_t pending(int64_t index, int64_t stream_id) {
  Locked g;
  StreamState& s = stream_state(static_cast<c10::DeviceIndex>(index), stream_id);
  return s.enqueued - s.executed;
}

int64_t memory_allocated(int64_t index) {
  check_index(static_cast<int>(index), "memory_allocated");
  std::lock_guard<std::mutex> g(blocks().m);
  return blocks().bytes[index];
}

}  // namespace
}  // namespace fdpaccel

TORCH_LIBRARY(fdpaccel, m) {
  m.def("configure(int devices, bool asynchronous) -> ()", &fdpaccel::configure);
  m.def("device_count() -> int", [] { return static_cast<int64_t>(fdpaccel::devices().load()); });
  m.def("asynchronous() -> bool", [] { return fdpaccel::asynchronous().load(); });
  m.def("current_device() -> int",
        [] { return static_cast<int64_t>(fdpaccel::current_device()); });
  m.def("set_device(int index) -> ()", [](int64_t i) {
    fdpaccel::guard().setDevice({fdpaccel::kType, static_cast<c10::DeviceIndex>(i)});
  });
  m.def("synchronize(int index) -> ()",
        [](int64_t i) { fdpaccel::synchronize_device(static_cast<int>(i)); });
  m.def("pending(int index, int stream_id) -> int", &fdpaccel::pending);
  m.def("memory_allocated(int index) -> int", &fdpaccel::memory_allocated);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &fdpaccel::empty);
  m.impl("empty_strided", &fdpaccel::empty_strided);
  m.impl("_copy_from", &fdpaccel::copy_from);
  m.impl("_copy_from_and_resize", &fdpaccel::copy_from_and_resize);
  m.impl("resize_", &fdpaccel::resize_);
  m.impl("set_.source_Storage_storage_offset", &fdpaccel::set_storage);
  m.impl("set_.source_Storage", &fdpaccel::set_source_storage);
  m.impl("set_.source_Tensor", &fdpaccel::set_source_tensor);
  m.impl("set_", &fdpaccel::set_empty);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("unfold", &at::native::unfold);
  m.impl("view_as_real", &at::native::view_as_real);
  m.impl("view_as_complex", &at::native::view_as_complex);
  m.impl("convolution_overrideable", &fdpaccel::convolution);
  m.impl("convolution_backward_overrideable", &fdpaccel::convolution_backward);
  m.impl("native_batch_norm", &fdpaccel::native_batch_norm);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", &fdpaccel::fused_lstm_cell);
  m.impl("_thnn_fused_gru_cell", &fdpaccel::fused_gru_cell);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fdpaccel::fallback>());
}

// Autocast on this device type (torch.autocast("fdpaccel")): the matrix products in the lower
// precision, as on CUDA; every other op falls through to its kernel unchanged.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
}
