// The Python module `lily_metal_emu`: only the Metal entry points of lily._core (python/bindings_metal.cpp),
// built by metalsim.host.build_python_module against the fake Metal runtime, so tests/metal/test_metal_device.py
// runs the macOS bindings, host code and kernels end to end on Linux.
#include <nanobind/nanobind.h>

void bind_metal(nanobind::module_& m);

NB_MODULE(lily_metal_emu, m) { bind_metal(m); }
