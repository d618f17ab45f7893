// The C ABI between the three parts of the Metal emulator:
//   * a kernel library: MSL rewritten by msl2cpp.py and compiled by clang into a shared object; it exports
//     mslsim_library_get() describing its kernels, their bindings and its function constants;
//   * the runtime (libmslsim): runs one dispatch on its persistent worker pool, one fiber per lane;
//   * its hosts: the job runner used by the Python tests, and the fake Metal runtime (fakemetal) that
//     the real metal-cpp host code links against on Linux.
// Plain C so that every host can use it without sharing C++ types across shared-object boundaries.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSLSIM_ABI_VERSION 2
#define MSLSIM_MAX_BINDINGS 31  // Metal's buffer / threadgroup-memory argument table size

enum mslsim_arg_kind {
  MSLSIM_ARG_BUFFER = 0,       // [[buffer(i)]]: a device or constant pointer (or reference)
  MSLSIM_ARG_THREADGROUP = 1,  // [[threadgroup(i)]]: threadgroup memory sized by the host
};

typedef struct mslsim_arg {
  int kind;           // enum mslsim_arg_kind
  int index;          // the attribute's index
  const char* name;   // parameter name in the MSL source
  const char* type;   // parameter type as written (for messages)
  size_t min_bytes;   // bytes the kernel needs at least (sizeof the pointee for references), 0 = unknown
  // Added by the emulator (compatible extension): -1 when the argument is always used; otherwise the
  // index of the bool function constant named in [[buffer(i), function_constant(c)]] that enables it.
  int enabled_by_constant;
  // 1 when the kernel may write through the argument (a `device T*` or `device T&` whose pointee is not
  // const), 0 for `const device T*`, `constant T*`/`constant T&` and threadgroup memory. The fake Metal
  // runtime's hazard check uses it: two dispatches of one concurrent stage conflict when one may write
  // bytes the other binds.
  int writes;
} mslsim_arg;

typedef struct mslsim_function_constant {
  int index;          // [[function_constant(index)]]
  const char* name;
  const char* type;   // MSL scalar type name: bool, int, uint, short, ushort, float, half, ...
  size_t size;        // bytes of one value
  void* storage;      // the global the kernel code reads
  int* defined;       // 1 when the pipeline supplied a value (is_function_constant_defined)
} mslsim_function_constant;

typedef struct mslsim_kernel {
  const char* name;   // host name: the function name, or [[host_name("...")]] for template instances
  int n_args;
  const mslsim_arg* args;
  // Runs one lane of the kernel on the calling fiber. args[k] is the pointer for this->args[k]
  // (a buffer's contents plus offset, or the threadgroup's memory block for that index).
  void (*entry)(void* const* args);
  // Bytes of `threadgroup` variables declared in the kernel and in the same-file helper functions it
  // calls (each rounded up to 16 bytes): what Metal reports as staticThreadgroupMemoryLength. Exact for
  // declarations in the kernel body and in free helper functions; declarations in member functions and
  // lambdas are only seen at run time (mslsim_run counts them when they execute).
  size_t (*static_threadgroup_bytes)(void);
} mslsim_kernel;

typedef struct mslsim_library {
  int abi_version;    // MSLSIM_ABI_VERSION
  const char* source_name;
  int n_kernels;
  const mslsim_kernel* kernels;
  int n_constants;
  const mslsim_function_constant* constants;
  // Added by the emulator (compatible extension): recomputes program-scope `constant` variables whose
  // initializers use function constants, after mslsim_run stored the dispatch's values. May be NULL.
  void (*specialize)(void);
} mslsim_library;

// Every compiled kernel library exports this.
const mslsim_library* mslsim_library_get(void);

typedef struct mslsim_constant_value {
  int index;          // function constant index
  const void* data;
  size_t size;
} mslsim_constant_value;

typedef struct mslsim_dispatch {
  const mslsim_library* library;
  const mslsim_kernel* kernel;
  void* buffers[MSLSIM_MAX_BINDINGS];         // by [[buffer(i)]] index, offset already applied
  size_t buffer_bytes[MSLSIM_MAX_BINDINGS];   // bytes valid from buffers[i] (for argument validation)
  size_t threadgroup_bytes[MSLSIM_MAX_BINDINGS];  // by [[threadgroup(i)]] index
  const mslsim_constant_value* constants;
  int n_constants;
  uint32_t threadgroups[3];            // dispatchThreadgroups: grid size in threadgroups
  uint32_t threads_per_threadgroup[3];
  uint32_t grid_threads[3];            // all nonzero: dispatchThreads (edge threadgroups are partial)
  uint32_t execution_width;            // threads per simdgroup; 0 means 32
  uint64_t lane_shuffle_seed;          // 0: lanes scheduled in order; otherwise a seeded shuffled order
  int reverse_threadgroups;            // run threadgroups in reverse order (finds inter-group races)
  // 0: threadgroups start in order (or reversed); otherwise they start in a permutation drawn from this seed.
  uint64_t threadgroup_order_seed;
  // Device limits the dispatch must respect; 0 means the defaults of a recent Apple GPU (1024 threads per
  // threadgroup, 32 KiB of threadgroup memory). Static plus dynamic threadgroup memory must fit the limit.
  uint32_t max_threads_per_threadgroup;
  size_t max_threadgroup_memory;
  // Added by the emulator (compatible extension; NULL: off). Device-memory traffic of the dispatch: a library
  // built in traffic mode (metalsim.build, -fsanitize-coverage=trace-loads,trace-stores) reports every load and
  // store it executes; those that fall inside a bound buffer (buffers[i] .. + buffer_bytes[i]) are recorded, and
  // after the dispatch mslsim_run calls traffic(ctx, address, bytes, write) once for every maximal run of
  // distinct bytes read (write 0) or written (write 1), in address order, then once per kind with address NULL
  // and bytes = the sum of the sizes of all accesses of that kind (each re-read counted again).
  void (*traffic)(void* ctx, const void* address, size_t bytes, int write);
  void* traffic_ctx;
} mslsim_dispatch;

// Runs one dispatch to completion. Returns 0 on success; otherwise nonzero with a one-line message in err
// (unbound argument, divergent simd_* call, a lane that exited while others wait at a barrier, ...).
int mslsim_run(const mslsim_dispatch* dispatch, char* err, size_t err_size);

// Worker threads of the persistent pool (default: hardware concurrency). Threadgroups are spread over them.
void mslsim_set_workers(int workers);

#ifdef __cplusplus
}
#endif
