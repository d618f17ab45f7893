"""metalsim: Metal without a Mac.

The MSL emulator runs the project's unchanged ``.metal`` kernels on the CPU: clang compiles them as C++
through a shim ``metal_stdlib`` (include/), msl2cpp.py rewrites the few MSL constructs C++ lacks, and
libmslsim (runtime/) runs every lane as a fiber with real threadgroup-barrier and simdgroup semantics.
build.py builds and caches everything; emulator.py runs kernels from Python through a persistent job
runner (runner/); ``python -m metalsim compile`` is the command-line entry the fake Metal runtime uses.
Two builds: "typed" keeps MSL address spaces as clang address spaces (mixing them is a compile error),
"asan" erases them and adds ASan/UBSan. The runtime enforces the device's threadgroup-memory budget (static
declarations, counted at load time, plus [[threadgroup(i)]] lengths) and thread limits, and can start
threadgroups in seeded orders. fakemetal/ is the fake Metal runtime for host code (asynchronous command
buffers, in-flight buffer protection, barrier hazard check, configurable limits). docs/METAL_VERIFICATION.md
describes all of it, with its environment variables.
"""
