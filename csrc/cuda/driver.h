// The CUDA driver API and NVRTC, loaded at run time (dlopen): the extension links against neither, so
// one wheel builds without a CUDA toolkit and runs on machines with or without a GPU. Only the entry
// points Lily calls are declared, with the ABI of cuda.h / nvrtc.h (CUDA 12 and 13); every call's result
// is checked through check() / check_nvrtc(), which throw CudaError naming the call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace lily::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphNode = struct CUgraphNode_st*;
using CUgraphExec = struct CUgraphExec_st*;
using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DEFAULT = 0;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36;
constexpr int CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37;
constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;  // static shared memory
constexpr int CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3;   // local memory per thread (spills, stack)
constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9;  // percent of the SM's shared capacity, -1 none
constexpr int CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14;  // clusters of more than 8 blocks (sm_90)
inline void* const CU_LAUNCH_PARAM_END = reinterpret_cast<void*>(0x00);
inline void* const CU_LAUNCH_PARAM_BUFFER_POINTER = reinterpret_cast<void*>(0x01);
inline void* const CU_LAUNCH_PARAM_BUFFER_SIZE = reinterpret_cast<void*>(0x02);

// cuLaunchKernelEx's configuration (cuda.h: CUlaunchConfig, CUlaunchAttribute; CUDA 12+).
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
struct CUlaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int programmaticStreamSerializationAllowed;
    void* align;  // the union holds pointers in cuda.h: 8-byte aligned
  } value;
};
struct CUlaunchConfig {
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned numAttrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute layout");

// A failed CUDA or NVRTC call. `sticky` marks errors after which the context is unusable (device faults:
// an illegal address, a launch failure): the engine must be reloaded.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& what, CUresult code, bool sticky)
      : std::runtime_error(what), code_(code), sticky_(sticky) {}
  CUresult code() const { return code_; }
  bool sticky() const { return sticky_; }

 private:
  CUresult code_;
  bool sticky_;
};

struct Driver {
  bool loaded = false;
  std::string error;  // why not loaded
  std::string library;
#define LILY_CU_FUNCS(X)                                                                                  \
  X(cuInit, CUresult, (unsigned))                                                                         \
  X(cuDriverGetVersion, CUresult, (int*))                                                                 \
  X(cuDeviceGetCount, CUresult, (int*))                                                                   \
  X(cuDeviceGet, CUresult, (CUdevice*, int))                                                              \
  X(cuDeviceGetName, CUresult, (char*, int, CUdevice))                                                    \
  X(cuDeviceGetAttribute, CUresult, (int*, int, CUdevice))                                                \
  X(cuDeviceTotalMem_v2, CUresult, (size_t*, CUdevice))                                                   \
  X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext*, CUdevice))                                           \
  X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice))                                                   \
  X(cuCtxSetCurrent, CUresult, (CUcontext))                                                               \
  X(cuCtxSynchronize, CUresult, ())                                                                       \
  X(cuGetErrorName, CUresult, (CUresult, const char**))                                                   \
  X(cuGetErrorString, CUresult, (CUresult, const char**))                                                 \
  X(cuMemGetInfo_v2, CUresult, (size_t*, size_t*))                                                        \
  X(cuMemAlloc_v2, CUresult, (CUdeviceptr*, size_t))                                                      \
  X(cuMemFree_v2, CUresult, (CUdeviceptr))                                                                \
  X(cuMemAllocHost_v2, CUresult, (void**, size_t))                                                        \
  X(cuMemFreeHost, CUresult, (void*))                                                                     \
  X(cuMemcpyHtoDAsync_v2, CUresult, (CUdeviceptr, const void*, size_t, CUstream))                         \
  X(cuMemcpyDtoHAsync_v2, CUresult, (void*, CUdeviceptr, size_t, CUstream))                               \
  X(cuMemcpyDtoDAsync_v2, CUresult, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                         \
  X(cuMemsetD8Async, CUresult, (CUdeviceptr, unsigned char, size_t, CUstream))                            \
  X(cuMemsetD32Async, CUresult, (CUdeviceptr, unsigned, size_t, CUstream))                                \
  X(cuModuleLoadData, CUresult, (CUmodule*, const void*))                                                 \
  X(cuModuleUnload, CUresult, (CUmodule))                                                                 \
  X(cuModuleGetFunction, CUresult, (CUfunction*, CUmodule, const char*))                                  \
  X(cuFuncSetAttribute, CUresult, (CUfunction, int, int))                                                 \
  X(cuFuncGetAttribute, CUresult, (int*, int, CUfunction))                                                \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor, CUresult, (int*, CUfunction, int, size_t))               \
  X(cuLaunchKernel, CUresult,                                                                             \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**,  \
     void**))                                                                                             \
  X(cuStreamCreate, CUresult, (CUstream*, unsigned))                                                      \
  X(cuStreamDestroy_v2, CUresult, (CUstream))                                                             \
  X(cuStreamSynchronize, CUresult, (CUstream))                                                            \
  X(cuStreamWaitEvent, CUresult, (CUstream, CUevent, unsigned))                                           \
  X(cuEventCreate, CUresult, (CUevent*, unsigned))                                                        \
  X(cuEventDestroy_v2, CUresult, (CUevent))                                                               \
  X(cuEventRecord, CUresult, (CUevent, CUstream))                                                         \
  X(cuEventQuery, CUresult, (CUevent))                                                                    \
  X(cuEventSynchronize, CUresult, (CUevent))                                                              \
  X(cuStreamBeginCapture_v2, CUresult, (CUstream, int))                                                   \
  X(cuStreamEndCapture, CUresult, (CUstream, CUgraph*))                                                   \
  X(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec*, CUgraph, unsigned long long))                   \
  X(cuGraphGetNodes, CUresult, (CUgraph, CUgraphNode*, size_t*))                                          \
  X(cuGraphLaunch, CUresult, (CUgraphExec, CUstream))                                                     \
  X(cuGraphExecDestroy, CUresult, (CUgraphExec))                                                          \
  X(cuGraphDestroy, CUresult, (CUgraph))
#define LILY_DECLARE_CU(name, ret, args) ret(*name) args = nullptr;
  LILY_CU_FUNCS(LILY_DECLARE_CU)
#undef LILY_DECLARE_CU
  // Optional: timing events (the name changed in CUDA 12.8 / 13); launches with attributes (PDL).
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
};

struct Nvrtc {
  bool loaded = false;
  std::string error;
  std::string library;
  int major = 0, minor = 0;
#define LILY_NVRTC_FUNCS(X)                                                                        \
  X(nvrtcVersion, nvrtcResult, (int*, int*))                                                       \
  X(nvrtcGetErrorString, const char*, (nvrtcResult))                                               \
  X(nvrtcCreateProgram, nvrtcResult,                                                               \
    (nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*))        \
  X(nvrtcDestroyProgram, nvrtcResult, (nvrtcProgram*))                                             \
  X(nvrtcCompileProgram, nvrtcResult, (nvrtcProgram, int, const char* const*))                     \
  X(nvrtcGetProgramLogSize, nvrtcResult, (nvrtcProgram, size_t*))                                  \
  X(nvrtcGetProgramLog, nvrtcResult, (nvrtcProgram, char*))                                        \
  X(nvrtcGetCUBINSize, nvrtcResult, (nvrtcProgram, size_t*))                                       \
  X(nvrtcGetCUBIN, nvrtcResult, (nvrtcProgram, char*))
#define LILY_DECLARE_NVRTC(name, ret, args) ret(*name) args = nullptr;
  LILY_NVRTC_FUNCS(LILY_DECLARE_NVRTC)
#undef LILY_DECLARE_NVRTC
};

// The process-wide tables, loaded on first use (thread-safe). driver() never throws: check .loaded.
// nvrtc() searches LILY_NVRTC (a path), then the paths set by set_nvrtc_search_paths (the Python side
// passes the nvidia-cuda-nvrtc wheel's folder and CUDA_HOME's), then the system's loader.
const Driver& driver();
const Nvrtc& nvrtc();
void set_nvrtc_search_paths(const std::vector<std::string>& paths);

// Throws CudaError naming `what` unless r is CUDA_SUCCESS.
void check(CUresult r, const char* what);
std::string error_text(CUresult r);
bool is_sticky(CUresult r);

}  // namespace lily::cuda
