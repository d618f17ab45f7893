// Loads libcuda and libnvrtc with dlopen on first use (driver.h).
#include "cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace lily::cuda {
namespace {

std::mutex g_paths_mu;  // guards g_nvrtc_paths
std::vector<std::string> g_nvrtc_paths;

template <class F>
bool bind(void* lib, const char* name, F& out, std::string& missing) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (!out) missing += (missing.empty() ? "" : ", ") + std::string(name);
  return out != nullptr;
}

Driver load_driver() {
  Driver d;
  void* lib = nullptr;
  std::string why;
  for (const char* name : {"libcuda.so.1", "libcuda.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      d.library = name;
      break;
    }
    const char* e = dlerror();
    if (why.empty() && e) why = e;
  }
  if (!lib) {
    d.error = "no NVIDIA driver (libcuda.so.1 could not be loaded: " + (why.empty() ? std::string("?") : why) + ")";
    return d;
  }
  std::string missing;
#define LILY_BIND_CU(name, ret, args) bind(lib, #name, d.name, missing);
  LILY_CU_FUNCS(LILY_BIND_CU)
#undef LILY_BIND_CU
  if (!missing.empty()) {
    d.error = "the NVIDIA driver is too old for Lily (CUDA 12 or newer needed): it lacks " + missing;
    return d;
  }
  std::string optional;  // absent optional entry points only switch their feature off
  if (!bind(lib, "cuEventElapsedTime_v2", d.cuEventElapsedTime, optional))
    bind(lib, "cuEventElapsedTime", d.cuEventElapsedTime, optional);
  bind(lib, "cuLaunchKernelEx", d.cuLaunchKernelEx, optional);
  const CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* s = nullptr;
    d.cuGetErrorString(r, &s);
    d.error = "the NVIDIA driver did not initialise (cuInit: " + std::string(s ? s : "error " + std::to_string(r)) + ")";
    return d;
  }
  d.loaded = true;
  return d;
}

Nvrtc load_nvrtc() {
  Nvrtc n;
  std::vector<std::string> cands;
  if (const char* env = std::getenv("LILY_NVRTC")) cands.push_back(env);
  {
    std::lock_guard<std::mutex> lk(g_paths_mu);
    cands.insert(cands.end(), g_nvrtc_paths.begin(), g_nvrtc_paths.end());
  }
  for (const char* s : {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"}) cands.push_back(s);
  void* lib = nullptr;
  std::string tried;
  for (const std::string& c : cands) {
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      n.library = c;
      break;
    }
    tried += (tried.empty() ? "" : ", ") + c;
  }
  if (!lib) {
    n.error = "NVRTC (the CUDA run-time compiler Lily builds its kernels with) was not found; install it with "
              "pip install 'lily-inference[cuda]' (the nvidia-cuda-nvrtc wheel) or point LILY_NVRTC at "
              "libnvrtc.so (tried: " + tried + ")";
    return n;
  }
  std::string missing;
#define LILY_BIND_NVRTC(name, ret, args) bind(lib, #name, n.name, missing);
  LILY_NVRTC_FUNCS(LILY_BIND_NVRTC)
#undef LILY_BIND_NVRTC
  if (!missing.empty()) {
    n.error = "NVRTC at " + n.library + " lacks " + missing + " (CUDA 12 or newer needed)";
    return n;
  }
  n.nvrtcVersion(&n.major, &n.minor);
  if (n.major < 12) {
    n.error = "NVRTC " + std::to_string(n.major) + "." + std::to_string(n.minor) + " at " + n.library +
              " is too old (CUDA 12 or newer needed)";
    return n;
  }
  n.loaded = true;
  return n;
}

}  // namespace

const Driver& driver() {
  static const Driver d = load_driver();
  return d;
}

const Nvrtc& nvrtc() {
  static const Nvrtc n = load_nvrtc();
  return n;
}

void set_nvrtc_search_paths(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lk(g_paths_mu);
  g_nvrtc_paths = paths;
}

std::string error_text(CUresult r) {
  const Driver& d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString) d.cuGetErrorString(r, &text);
  return std::string(name ? name : "CUDA error " + std::to_string(r)) + (text ? std::string(": ") + text : "");
}

// Errors after which the context is unusable (cuda.h: "the context cannot be used ... and must be destroyed").
bool is_sticky(CUresult r) {
  switch (r) {
    case 700:  // CUDA_ERROR_ILLEGAL_ADDRESS
    case 702:  // CUDA_ERROR_LAUNCH_TIMEOUT
    case 714:  // CUDA_ERROR_HARDWARE_STACK_ERROR
    case 715:  // CUDA_ERROR_ILLEGAL_INSTRUCTION
    case 716:  // CUDA_ERROR_MISALIGNED_ADDRESS
    case 717:  // CUDA_ERROR_INVALID_ADDRESS_SPACE
    case 718:  // CUDA_ERROR_INVALID_PC
    case 719:  // CUDA_ERROR_LAUNCH_FAILED
    case 999:  // CUDA_ERROR_UNKNOWN
      return true;
    default:
      return false;
  }
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  throw CudaError(std::string(what) + " failed: " + error_text(r), r, is_sticky(r));
}

}  // namespace lily::cuda
