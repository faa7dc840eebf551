// A multi-device test accelerator on torch's PrivateUse1 extension points: the device guard
// (devices, streams, events), the hooks, the allocators, the ops that own memory or views, and a
// CPU fallback for every other op. Built by tests/accel/__init__.py.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

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
    TORCH_CHECK(it != blocks().live.end(), "fdpaccel: ", data, " is not the start of device memory");
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

bool on_device(const at::Tensor& t) { return t.device().type() == kType; }

c10::DeviceIndex target_index(std::optional<c10::Device> device) {
  TORCH_CHECK(!device || device->type() == kType, "fdpaccel: expected a device of this type, got ",
              *device);
  const c10::DeviceIndex i = resolve(device ? device->index() : -1);
  check_index(i, "empty");
  return i;
}

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout, std::optional<c10::Device> device,
                 std::optional<bool> /*pin_memory*/, std::optional<at::MemoryFormat> format) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "fdpaccel empty: strided layout only");
  return at::detail::empty_generic(size, allocator(target_index(device)),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
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
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
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

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format) impl->empty_tensor_restride(*format);
  const size_t need = at::detail::computeStorageNbytes(size, self.strides(), self.itemsize(),
                                                       self.storage_offset());
  if (need > self.storage().nbytes()) resize_storage_bytes(self.storage(), need);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.sizes() != src.sizes()) {
    if (on_device(dst)) {
      resize_(dst, src.sizes(), std::nullopt);
    } else {
      dst.resize_(src.sizes());
    }
  }
  return copy_from(src, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset,
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

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / self.itemsize();
  return set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty_storage(c10::Storage::use_byte_size_t(), 0,
                             allocator(self.device().index()), true);
  return set_storage(self, std::move(empty_storage), 0, {0}, {});
}

// Checks the devices of an op's tensors as CUDA's kernels do: one device per op, or for the
// _foreach_ ops one device per list position. Returns the device the op runs on.
std::optional<c10::Device> op_device(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const bool foreach = op.schema().name().rfind("aten::_foreach_", 0) == 0;
  std::optional<c10::Device> first;
  std::vector<std::optional<c10::Device>> per_position;
  std::set<c10::DeviceIndex> used;
  auto seen = [&](const at::Tensor& t, std::optional<size_t> position) {
    if (!t.defined() || !on_device(t)) return;
    used.insert(t.device().index());
    if (!first) first = t.device();
    std::optional<c10::Device>* expected = &first;
    if (foreach && position) {
      if (per_position.size() <= *position) per_position.resize(*position + 1);
      expected = &per_position[*position];
      if (!*expected) *expected = t.device();
    } else if (foreach) {
      return;
    }
    TORCH_CHECK(**expected == t.device(), "Expected all tensors to be on the same device, but "
                "found at least two devices, ", **expected, " and ", t.device(),
                "! (when checking arguments for ", op.schema().name(), ")");
  };
  for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size())) {
    if (v.isTensor()) {
      seen(v.toTensor(), std::nullopt);
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) seen(list.get(i), i);
    } else if (v.isOptionalTensorList()) {
      const auto list = v.toOptionalTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        const std::optional<at::Tensor> t = list.get(i);
        if (t) seen(*t, foreach ? std::optional<size_t>(i) : std::nullopt);
      }
    }
  }
  if (foreach && used.size() > 1) {
    for (const c10::Argument& r : op.schema().returns())
      TORCH_CHECK(!r.type()->isSubtypeOf(*c10::ListType::ofTensors()), "fdpaccel: ",
                  op.schema().name(), " on tensors of several devices returns new tensors, which "
                  "the CPU fallback would put on one device: not supported by the test device");
  }
  return first;
}

// Every op without a kernel here runs on the host: its tensors are copied to the CPU (draining
// their device's current stream), the CPU kernel runs, and results go back to the op's device.
// View ops must have a kernel here (error_on_views): a host copy is not a view.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::optional<c10::Device> device = op_device(op, stack);
  c10::OptionalDeviceGuard on(device);
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

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
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fdpaccel::fallback>());
}
