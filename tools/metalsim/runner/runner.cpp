// mslsim-runner: the job runner behind metalsim.emulator.Emulator. One persistent process per Emulator
// loads kernel libraries and runs dispatches through libmslsim, so a dispatch costs no process start.
//
// Protocol on stdin/stdout (a request is a text line of integers and names, then raw byte blobs):
//   LOAD <n>\n<path: n bytes>              -> OK <n>\n<json: n bytes>   (library id, kernels, constants)
//   WORKERS <count>\n                       -> OK 0\n
//   RUN <lib> <name_len> <tg x y z> <grid x y z> <threads x y z> <seed> <reverse> <tg_seed> <nbuf> <ntgm> <nconst>\n
//       <name>, then nbuf x (<index> <n>\n<n bytes>), ntgm x (<index> <n>\n), nconst x (<index> <n>\n<n bytes>)
//                                           -> OK <nbuf>\n then nbuf x (<index> <n>\n<n bytes>)
//   any failure                             -> ERR <n>\n<message: n bytes>
// Buffers are malloc'd at their exact size, so ASan reports a kernel reading past the end.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mslsim/abi.h"

namespace {

bool read_exact(void* p, size_t n) {
  char* c = (char*)p;
  while (n) {
    ssize_t r = read(0, c, n);
    if (r <= 0) return false;
    c += r;
    n -= (size_t)r;
  }
  return true;
}

void write_exact(const void* p, size_t n) {
  const char* c = (const char*)p;
  while (n) {
    ssize_t r = write(1, c, n);
    if (r <= 0) exit(3);  // the Python side went away
    c += r;
    n -= (size_t)r;
  }
}

bool read_line(std::string& line) {
  line.clear();
  char c;
  for (;;) {
    if (!read_exact(&c, 1)) return false;
    if (c == '\n') return true;
    line.push_back(c);
  }
}

void reply(const char* status, const std::string& payload) {
  std::string head = std::string(status) + " " + std::to_string(payload.size()) + "\n";
  write_exact(head.data(), head.size());
  write_exact(payload.data(), payload.size());
}

std::string json_str(const char* s) {
  std::string out = "\"";
  for (; s && *s; ++s) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      out += '\\';
      out += (char)c;
    } else if (c < 0x20) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += (char)c;
    }
  }
  return out + "\"";
}

std::string describe(const mslsim_library* lib, int id) {
  std::string j = "{\"id\":" + std::to_string(id) + ",\"kernels\":[";
  for (int k = 0; k < lib->n_kernels; ++k) {
    const mslsim_kernel& kern = lib->kernels[k];
    if (k) j += ",";
    j += "{\"name\":" + json_str(kern.name) + ",\"args\":[";
    for (int a = 0; a < kern.n_args; ++a) {
      const mslsim_arg& arg = kern.args[a];
      if (a) j += ",";
      j += "{\"kind\":" + std::to_string(arg.kind) + ",\"index\":" + std::to_string(arg.index) +
           ",\"name\":" + json_str(arg.name) + ",\"type\":" + json_str(arg.type) +
           ",\"min_bytes\":" + std::to_string(arg.min_bytes) +
           ",\"enabled_by_constant\":" + std::to_string(arg.enabled_by_constant) +
           ",\"writes\":" + std::to_string(arg.writes) + "}";
    }
    j += "],\"static_threadgroup_bytes\":" +
         std::to_string(kern.static_threadgroup_bytes ? kern.static_threadgroup_bytes() : 0) + "}";
  }
  j += "],\"constants\":[";
  for (int c = 0; c < lib->n_constants; ++c) {
    const mslsim_function_constant& fc = lib->constants[c];
    if (c) j += ",";
    j += "{\"index\":" + std::to_string(fc.index) + ",\"name\":" + json_str(fc.name) +
         ",\"type\":" + json_str(fc.type) + ",\"size\":" + std::to_string(fc.size) + "}";
  }
  return j + "]}";
}

const char* g_kernel = "";  // the kernel being run, for the crash message

// A crash inside a kernel (without ASan, which reports it itself): say which kernel and what the likely
// causes are, then die with the signal so the Python side sees it.
void on_fatal_signal(int sig, siginfo_t* info, void*) {
  char buf[512];
  int n = snprintf(buf, sizeof buf,
                   "mslsim-runner: %s at address %p while running kernel '%s' (a wild pointer, or a lane's "
                   "fiber stack overflowed: 64 KiB per lane, keep large arrays out of thread memory)\n",
                   sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "fatal signal", info->si_addr, g_kernel);
  if (n > 0) (void)!write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
  signal(sig, SIG_DFL);
  raise(sig);
}

struct Blob {
  int index;
  std::vector<char> data;  // constants
  char* mem = nullptr;     // buffers: malloc'd at the exact size
  size_t size = 0;
};

}  // namespace

int main() {
#if !defined(__SANITIZE_ADDRESS__) && !(defined(__has_feature) && __has_feature(address_sanitizer))
  struct sigaction sa = {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
#endif
  std::vector<const mslsim_library*> libs;
  std::string line;
  while (read_line(line)) {
    char cmd[16] = {};
    sscanf(line.c_str(), "%15s", cmd);
    if (!strcmp(cmd, "QUIT")) break;
    if (!strcmp(cmd, "WORKERS")) {
      int n = 0;
      sscanf(line.c_str(), "%*s %d", &n);
      mslsim_set_workers(n);
      reply("OK", "");
      continue;
    }
    if (!strcmp(cmd, "LOAD")) {
      size_t n = 0;
      sscanf(line.c_str(), "%*s %zu", &n);
      std::string path(n, '\0');
      if (!read_exact(&path[0], n)) return 2;
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        reply("ERR", std::string("cannot load ") + path + ": " + dlerror());
        continue;
      }
      auto get = (const mslsim_library* (*)(void))dlsym(h, "mslsim_library_get");
      if (!get) {
        reply("ERR", path + " is not a kernel library (no mslsim_library_get)");
        continue;
      }
      libs.push_back(get());
      reply("OK", describe(libs.back(), (int)libs.size() - 1));
      continue;
    }
    if (!strcmp(cmd, "RUN")) {
      int lib = 0, reverse = 0, nbuf = 0, ntgm = 0, nconst = 0;
      size_t name_len = 0;
      unsigned long long seed = 0, tg_seed = 0;
      unsigned tg[3], grid[3], tpt[3];
      int got = sscanf(line.c_str(), "%*s %d %zu %u %u %u %u %u %u %u %u %u %llu %d %llu %d %d %d", &lib, &name_len,
                       &tg[0], &tg[1], &tg[2], &grid[0], &grid[1], &grid[2], &tpt[0], &tpt[1], &tpt[2], &seed, &reverse,
                       &tg_seed, &nbuf, &ntgm, &nconst);
      if (got != 17) return 2;
      std::string name(name_len, '\0');
      if (!read_exact(&name[0], name_len)) return 2;
      std::vector<Blob> bufs(nbuf), consts(nconst);
      mslsim_dispatch d;
      memset(&d, 0, sizeof d);
      for (int i = 0; i < nbuf; ++i) {
        if (!read_line(line)) return 2;
        sscanf(line.c_str(), "%d %zu", &bufs[i].index, &bufs[i].size);
        bufs[i].mem = (char*)malloc(bufs[i].size);
        if (!read_exact(bufs[i].mem, bufs[i].size)) return 2;
        if (bufs[i].index >= 0 && bufs[i].index < MSLSIM_MAX_BINDINGS) {
          d.buffers[bufs[i].index] = bufs[i].mem;
          d.buffer_bytes[bufs[i].index] = bufs[i].size;
        }
      }
      for (int i = 0; i < ntgm; ++i) {
        int index = 0;
        size_t n = 0;
        if (!read_line(line)) return 2;
        sscanf(line.c_str(), "%d %zu", &index, &n);
        if (index >= 0 && index < MSLSIM_MAX_BINDINGS) d.threadgroup_bytes[index] = n;
      }
      std::vector<mslsim_constant_value> cv(nconst);
      for (int i = 0; i < nconst; ++i) {
        size_t n = 0;
        if (!read_line(line)) return 2;
        sscanf(line.c_str(), "%d %zu", &consts[i].index, &n);
        consts[i].data.resize(n ? n : 1);
        if (!read_exact(consts[i].data.data(), n)) return 2;
        cv[i] = mslsim_constant_value{consts[i].index, consts[i].data.data(), n};
      }
      std::string err;
      if (lib < 0 || lib >= (int)libs.size()) {
        err = "unknown library id";
      } else {
        d.library = libs[lib];
        for (int k = 0; k < d.library->n_kernels; ++k)
          if (name == d.library->kernels[k].name) d.kernel = &d.library->kernels[k];
        if (!d.kernel) err = "no kernel named '" + name + "' in " + d.library->source_name;
      }
      if (err.empty()) {
        for (int a = 0; a < 3; ++a) {
          d.threadgroups[a] = tg[a];
          d.grid_threads[a] = grid[a];
          d.threads_per_threadgroup[a] = tpt[a];
        }
        d.constants = cv.data();
        d.n_constants = nconst;
        d.lane_shuffle_seed = seed;
        d.reverse_threadgroups = reverse;
        d.threadgroup_order_seed = tg_seed;
        char msg[4096] = {};
        g_kernel = d.kernel->name;
        if (mslsim_run(&d, msg, sizeof msg) != 0) err = msg;
        g_kernel = "";
      }
      if (!err.empty()) {
        reply("ERR", err);
      } else {
        std::string head = "OK " + std::to_string(nbuf) + "\n";
        write_exact(head.data(), head.size());
        for (auto& b : bufs) {
          head = std::to_string(b.index) + " " + std::to_string(b.size) + "\n";
          write_exact(head.data(), head.size());
          write_exact(b.mem, b.size);
        }
      }
      for (auto& b : bufs) free(b.mem);
      continue;
    }
    reply("ERR", "unknown command: " + line);
  }
  return 0;
}
