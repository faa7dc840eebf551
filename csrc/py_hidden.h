#pragma once
// FASTDP_PY_HIDDEN: hidden visibility, as pybind11 gives its own types, for the classes bound in
// bindings.cpp and those holding py::object fields.

#if defined(__GNUC__)
#define FASTDP_PY_HIDDEN __attribute__((visibility("hidden")))
#else
#define FASTDP_PY_HIDDEN
#endif
