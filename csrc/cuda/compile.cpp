// NVRTC compilation of the kernel families and the on-disk cubin cache (backend.h: compile_module).
//
// A module is kernels/<family>.cu compiled with -D constants for one architecture. Its cache key is the
// full text that determines the cubin: the family's source, every header it may include, the options,
// the architecture and the NVRTC version. The file name carries a 64-bit hash of the key and the file
// holds the key itself, so a hash collision or a stale file is a miss, never a wrong kernel.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/backend.h"

namespace lily::cuda {
namespace {

void check_nvrtc(nvrtcResult r, const char* what) {
  if (r == 0) return;
  throw CudaError(std::string(what) + " failed: " + nvrtc().nvrtcGetErrorString(r), r, false);
}

std::vector<std::string> options_for(const Defines& defines, int arch) {
  std::vector<std::string> o = {"--gpu-architecture=sm_" + std::to_string(arch), "--std=c++17", "-default-device",
                                "--extra-device-vectorization"};
  for (const auto& [k, v] : defines) o.push_back("-D" + k + "=" + std::to_string(v));
  return o;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i)
    if (i == path.size() || path[i] == '/') mkdir(path.substr(0, i).c_str(), 0755);
}

}  // namespace

std::string compile_module(const std::string& family, const Defines& defines, int arch, double* seconds) {
  const Nvrtc& n = nvrtc();
  if (!n.loaded) throw CudaError(n.error, -1, false);
  const char* src = kernel_source(family + ".cu");
  if (!src) throw std::logic_error("no CUDA kernel family '" + family + "' (csrc/cuda/kernels/" + family + ".cu)");
  std::vector<std::string> header_names, header_texts;
  for (const std::string& f : kernel_files())
    if (f.size() > 4 && f.compare(f.size() - 4, 4, ".cuh") == 0) {
      header_names.push_back(f);
      header_texts.push_back(kernel_source(f));
    }
  std::vector<const char*> hn, ht;
  for (size_t i = 0; i < header_names.size(); ++i) {
    hn.push_back(header_names[i].c_str());
    ht.push_back(header_texts[i].c_str());
  }
  const auto t0 = std::chrono::steady_clock::now();
  nvrtcProgram prog = nullptr;
  check_nvrtc(n.nvrtcCreateProgram(&prog, src, (family + ".cu").c_str(), int(hn.size()), ht.data(), hn.data()),
              "nvrtcCreateProgram");
  const std::vector<std::string> opts = options_for(defines, arch);
  std::vector<const char*> co;
  for (const auto& o : opts) co.push_back(o.c_str());
  const nvrtcResult r = n.nvrtcCompileProgram(prog, int(co.size()), co.data());
  size_t log_size = 0;
  n.nvrtcGetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size) n.nvrtcGetProgramLog(prog, log.data());
  if (r != 0) {
    n.nvrtcDestroyProgram(&prog);
    std::string d;
    for (const auto& o : opts) d += " " + o;
    throw CudaError("NVRTC could not compile kernels/" + family + ".cu (" + d.substr(1) + "):\n" + log, r, false);
  }
  size_t size = 0;
  check_nvrtc(n.nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize");
  std::string cubin(size, '\0');
  check_nvrtc(n.nvrtcGetCUBIN(prog, cubin.data()), "nvrtcGetCUBIN");
  n.nvrtcDestroyProgram(&prog);
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return cubin;
}

// The cache: cubin for (family, defines, arch), from disk when a previous process compiled it.
std::string cached_module(const std::string& dir, const std::string& family, const Defines& defines, int arch,
                          bool* hit, double* seconds) {
  const Nvrtc& n = nvrtc();
  if (!n.loaded) throw CudaError(n.error, -1, false);
  // Built with std::string (no iostreams: a stream's locale facets are one more thing that can differ
  // between the C++ runtime Lily was built with and the one a host process loaded).
  std::string k = "lily-cuda-module/1\n" + family + "\nsm_" + std::to_string(arch) + "\nnvrtc " +
                  std::to_string(n.major) + "." + std::to_string(n.minor) + "\n";
  for (const auto& o : options_for(defines, arch)) k += o + "\n";
  for (const std::string& f : kernel_files())  // the family and every header it may include
    if (f == family + ".cu" || (f.size() > 4 && f.compare(f.size() - 4, 4, ".cuh") == 0))
      k += "== " + f + "\n" + kernel_source(f) + "\n";
  char name[64];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(fnv1a(k)));
  const std::string path = dir.empty() ? "" : dir + "/" + family + "-sm" + std::to_string(arch) + "-" + name + ".cubin";
  static const char kMagic[] = "LILYCUBN";
  *hit = false;
  if (!path.empty()) {
    if (FILE* in = std::fopen(path.c_str(), "rb")) {
      std::string all;
      char buf[1 << 16];
      size_t got;
      while ((got = std::fread(buf, 1, sizeof buf, in)) > 0) all.append(buf, got);
      std::fclose(in);
      if (all.size() > k.size() + 8 && all.compare(0, 8, kMagic) == 0 && all.compare(8, k.size(), k) == 0) {
        *hit = true;
        if (seconds) *seconds = 0;
        return all.substr(8 + k.size());
      }
    }
  }
  std::string cubin = compile_module(family, defines, arch, seconds);
  if (!path.empty()) {  // best effort: an unwritable cache only costs the next process a compile
    make_dirs(dir);
    const std::string tmp = path + ".tmp" + std::to_string(getpid());
    bool ok = false;
    if (FILE* out = std::fopen(tmp.c_str(), "wb")) {
      ok = std::fwrite(kMagic, 1, 8, out) == 8 && std::fwrite(k.data(), 1, k.size(), out) == k.size() &&
           std::fwrite(cubin.data(), 1, cubin.size(), out) == cubin.size();
      ok = (std::fclose(out) == 0) && ok;
    }
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
  }
  return cubin;
}

std::string default_cache_dir() {
  if (const char* d = std::getenv("LILY_CACHE_DIR")) return std::string(d) + "/cuda";
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return std::string(x) + "/lily/cuda";
  if (const char* h = std::getenv("HOME")) return std::string(h) + "/.cache/lily/cuda";
  return "";
}

}  // namespace lily::cuda
