// The fake Metal classes: enough of MTLDevice, MTLCommandQueue, MTLCommandBuffer, MTLComputeCommandEncoder,
// MTLBlitCommandEncoder, MTLBuffer, MTLLibrary, MTLFunction, MTLFunctionConstantValues,
// MTLComputePipelineState and MTLCompileOptions that Lily's Metal backend (csrc/metal), built for Linux
// against metal-cpp, runs unchanged. Kernels are real: newLibraryWithSource compiles the MSL with the metalsim
// emulator (python -m metalsim compile) and each dispatch runs on libmslsim (mslsim_run).
//
// What the fake checks, and how a failure shows:
//   * encoding misuse that Metal's validation layer asserts on (a second open encoder, a message after
//     endEncoding, commit with an open encoder, waiting on an uncommitted command buffer, argument index out
//     of range): a fatal error naming the call;
//   * dispatch arguments, checked when the command buffer runs (every [[buffer(i)]] the kernel declares is
//     bound with at least the bytes the kernel needs, [[threadgroup(i)]] lengths set, threadgroup size and
//     memory within the device limits) and kernel errors reported by the emulator: the command buffer ends with
//     status Error and an NSError whose localizedDescription says what failed; later dispatches do not run;
//   * missing memory barriers: a concurrent encoder records its dispatches in stages split by barriers that
//     order buffers (a scope including MTLBarrierScopeBuffers); a resource barrier stays inside its stage and
//     orders only the listed resources. After each stage the hazard check reports two dispatches no barrier
//     orders that touch overlapping bytes of a buffer where one writes (FAKEMETAL_HAZARDS=0: off). The stage
//     runs in a valid order: recorded, latest-ready-first with FAKEMETAL_REVERSE=1 (threadgroups reversed
//     too), or seeded with FAKEMETAL_ORDER_SEED, so a consumer placed with its producer reads stale data;
//   * asynchronous execution: commit returns at once, a GPU thread per queue runs command buffers in enqueue
//     order, completed handlers run on a handler thread; the CPU view of every shared buffer an in-flight
//     command buffer binds is protected, so a racing CPU access stops the process naming buffer and command
//     buffer (FAKEMETAL_SYNC=1: run inside commit instead);
//   * device limits from LILY_METALSIM_* variables (threads per threadgroup, threadgroup memory, buffer length,
//     working set), static threadgroup memory per pipeline, and safe math (fast-math libraries are refused);
//   * lifetimes as Metal documents them: computeCommandEncoder / commandBuffer return autoreleased (+0)
//     objects, and the command buffer does not keep its encoder alive for the caller (Metal promises no such
//     thing), so code that keeps an encoder past its autorelease pool without retaining it fails with
//     "Command encoder released without endEncoding"; a command buffer retains the buffers and pipelines its
//     dispatches use until it completes (commandBufferWithUnretainedReferences: it does not).
// The MSL given to newLibraryWithSource is written to <metalsim cache>/fakemetal-msl/msl-<hash>.metal and
// compiled there (the emulator caches libraries by content), so a source compiles once across processes.
//
// Environment (read when needed):
//   FAKEMETAL_REVERSE=1           reverse dispatch order within stages and threadgroup order within dispatches
//   FAKEMETAL_ORDER_SEED=<seed>   seeded dispatch order within stages and threadgroup order within dispatches
//   FAKEMETAL_SHUFFLE=<seed>      shuffled lane scheduling in the emulator (0 or unset: in order)
//   FAKEMETAL_HAZARDS=0           no hazard check
//   FAKEMETAL_SYNC=1              command buffers run inside commit (no threads, no in-flight protection)
//   FAKEMETAL_GPU_DELAY_MS=<n>    a committed command buffer starts when waited on, or after n ms (default 50)
//   FAKEMETAL_ALLOW_FAST_MATH=1   accept libraries compiled with fast or relaxed math
//   FAKEMETAL_TRAFFIC=<file>      (traffic-mode builds) append each dispatch's device-memory traffic and each
//                                 command buffer's totals to <file> as JSON lines (see "device-memory traffic")
//   LILY_METALSIM_MAX_THREADS_PER_THREADGROUP, LILY_METALSIM_MAX_THREADGROUP_MEMORY,
//   LILY_METALSIM_MAX_BUFFER_LENGTH, LILY_METALSIM_WORKING_SET_SIZE   the device's limits
//   LILY_METALSIM_TOOLS=<dir>     the folder holding the metalsim package (default: fixed at build time)
//   FAKEMETAL_PYTHON=<exe>        the Python that runs the emulator's compiler (default: fixed at build time)
//   LILY_METALSIM_CACHE=<dir>     the metalsim cache (default ~/.cache/lily/metalsim)
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
#include <dlfcn.h>
#include <fcntl.h>
#include <mslsim/abi.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "objc.h"

#ifndef FAKEMETAL_MODE
#define FAKEMETAL_MODE "typed"
#endif
#ifndef FAKEMETAL_TOOLS_DIR
#define FAKEMETAL_TOOLS_DIR ""
#endif
#ifndef FAKEMETAL_PYTHON
#define FAKEMETAL_PYTHON "python3"
#endif

extern char** environ;

namespace fakemetal {
namespace {

constexpr int kMaxBindings = MSLSIM_MAX_BINDINGS;
constexpr unsigned long kThreadExecutionWidth = 32;
constexpr unsigned long kMaxSetBytes = 4096;  // Metal: setBytes is for data under 4 KB

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FAKEMETAL_ASAN 1
#endif
#endif
#ifndef FAKEMETAL_ASAN
#define FAKEMETAL_ASAN 0
#endif

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool env_flag(const char* name) {
  const char* v = getenv(name);
  return v && *v && strcmp(v, "0") != 0;
}

uint64_t env_u64(const char* name, uint64_t dflt) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const unsigned long long x = strtoull(v, &end, 0);
  return end && *end == 0 && x ? x : dflt;
}

// The device's limits: a recent Apple GPU by default, smaller (or larger) through the environment, read once.
// The emulator (libmslsim) reads the same variables, so a dispatch the device refuses is refused there too.
struct Limits {
  unsigned long max_threads;        // maxThreadsPerThreadgroup (each dimension) and per pipeline
  unsigned long max_tg_memory;      // maxThreadgroupMemoryLength
  unsigned long max_buffer;         // maxBufferLength
  uint64_t working_set;             // recommendedMaxWorkingSetSize
};
const Limits& limits() {
  static const Limits l = {
      (unsigned long)env_u64("LILY_METALSIM_MAX_THREADS_PER_THREADGROUP", 1024),
      (unsigned long)env_u64("LILY_METALSIM_MAX_THREADGROUP_MEMORY", 32768),
      (unsigned long)env_u64("LILY_METALSIM_MAX_BUFFER_LENGTH", 1ul << 36),
      env_u64("LILY_METALSIM_WORKING_SET_SIZE", 8ull << 30),
  };
  return l;
}
std::atomic<uint64_t> g_allocated{0};  // currentAllocatedSize

template <class T>
T* as(objc_object* o) {
  return static_cast<T*>(static_cast<Obj*>(o));
}

// Every Metal object: a label and, for objects that belong to a device, a strong reference to it.
struct MtlObj : Obj {
  objc_object* label = nullptr;
  objc_object* device = nullptr;
  ~MtlObj() {
    release(label);
    release(device);
  }
  void set_device(objc_object* d) {
    retain(d);
    device = d;
  }
};

ClassInfo* C_device;
ClassInfo* C_queue;
ClassInfo* C_command_buffer;
ClassInfo* C_compute_encoder;
ClassInfo* C_blit_encoder;
ClassInfo* C_buffer;
ClassInfo* C_library;
ClassInfo* C_function;
ClassInfo* C_constant_values;
ClassInfo* C_pipeline;
ClassInfo* C_compile_options;
ClassInfo* C_observer;

void set_error(objc_object** out, objc_object* err) {  // Cocoa convention: *error is autoreleased
  if (out) {
    *out = autorelease(err);
  } else {
    release(err);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Device, buffers, queue
// ---------------------------------------------------------------------------------------------------------

struct Device : MtlObj {
  objc_object* name = nullptr;
  ~Device();
};
std::mutex g_device_mu;
Device* g_device = nullptr;  // the system default device while it is alive (MTLCreateSystemDefaultDevice)
Device::~Device() {
  release(name);
  std::lock_guard<std::mutex> lock(g_device_mu);
  if (g_device == this) g_device = nullptr;
}

Device* default_device() {  // +1
  std::lock_guard<std::mutex> lock(g_device_mu);
  if (g_device) {
    retain(g_device);
    return g_device;
  }
  g_device = new_object<Device>(*C_device);
  // A string literal: not a counted object, so a leaked device shows as one leak, not two.
  g_device->name = reinterpret_cast<objc_object*>(MTLSTR("Lily fake Metal device (metalsim emulator)"));
  return g_device;
}

// In-flight protection (typed builds): a shared buffer's memory is mapped twice, a CPU view (contents()) and
// a GPU view (what dispatches, copies and fills use). While a committed command buffer that binds the buffer
// has not completed, the CPU view is protected: PROT_NONE when that work may write the buffer, PROT_READ when
// it only reads it. A CPU access that races with the GPU then faults, and the SIGSEGV handler names the buffer
// and the command buffer. ASan builds keep malloc'd memory (ASan reports overflows and use after free there)
// and have no in-flight protection.
struct Protected {
  size_t length = 0;  // bytes of the CPU view's mapping
  int writers = 0, readers = 0;
  std::string buffer;  // description for the fault message
  std::vector<std::string> users;  // command buffers in flight that bind it (descriptions)
};
std::mutex g_protect_mu;
std::map<char*, Protected>& protected_views() {  // CPU view -> state; a heap singleton (used by a signal handler)
  static auto* m = new std::map<char*, Protected>;
  return *m;
}
void apply_protection(char* view, const Protected& p) {
  const int prot = p.writers ? PROT_NONE : p.readers ? PROT_READ : PROT_READ | PROT_WRITE;
  if (mprotect(view, p.length, prot) != 0) die("mprotect: %s", strerror(errno));
}

size_t guard_bytes() { return size_t(sysconf(_SC_PAGESIZE)); }  // after each view of a mapped buffer

// The dispatch being run ("command buffer ..., encoder ..., kernel '...'"), for the fault message of a kernel
// that reads or writes outside its buffers (with several queues, the one started last).
std::atomic<const char*> g_running_dispatch{nullptr};

struct sigaction g_old_segv;
void on_segv(int sig, siginfo_t* info, void* ctx) {
  char* addr = static_cast<char*>(info->si_addr);
  const bool locked = g_protect_mu.try_lock();  // the faulting thread cannot hold it: it faulted in host code
  for (auto& [view, p] : protected_views()) {
    if (addr < view || addr >= view + p.length || (!p.writers && !p.readers)) continue;
    std::string msg = "fakemetal: CPU access to buffer " + p.buffer + " (byte " + std::to_string(addr - view) +
                      ") while command buffer " + (p.users.empty() ? std::string("?") : p.users.front()) +
                      " is in flight (" +
                      (p.writers ? "it may write the buffer: reading or writing it now races with the GPU"
                                 : "it reads the buffer: writing it now races with the GPU") +
                      "); wait for the command buffer (waitUntilCompleted, or its completed handler) first\n";
    (void)!write(2, msg.data(), msg.size());
    signal(SIGABRT, SIG_DFL);
    abort();
  }
  if (locked) g_protect_mu.unlock();
  if (const char* where = g_running_dispatch.load()) {  // a kernel's access outside every buffer it was bound
    const char* head = "fakemetal: SIGSEGV while running a dispatch: ";
    const char* tail = " touched memory outside its buffers (an index past a buffer's end: each buffer is "
                       "followed by an inaccessible page)\n";
    (void)!write(2, head, strlen(head));
    (void)!write(2, where, strlen(where));
    (void)!write(2, tail, strlen(tail));
  }
  // Not ours: hand the fault to whoever handled SIGSEGV before (a runner's crash report, or the default).
  if (g_old_segv.sa_flags & SA_SIGINFO) {
    if (g_old_segv.sa_sigaction) return g_old_segv.sa_sigaction(sig, info, ctx);
  } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
    return g_old_segv.sa_handler(sig);
  }
  signal(SIGSEGV, SIG_DFL);  // returning re-runs the access, which now dies with the default action
}
void install_segv_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = &on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
  });
}

struct Buffer : MtlObj {
  void* data = nullptr;  // the CPU view (contents())
  void* gpu = nullptr;   // the GPU view of the same pages, when double-mapped (else data serves both)
  size_t mapped = 0;     // bytes of each view's mapping when double-mapped
  size_t length = 0;
  unsigned long options = 0;
  bool owns = true;
  void* deallocator = nullptr;  // block void (^)(void*, NSUInteger), for newBufferWithBytesNoCopy
  char* gpu_data() const { return static_cast<char*>(gpu ? gpu : data); }
  ~Buffer() {
    g_allocated -= owns ? length : 0;
    if (mapped) {
      {
        std::lock_guard<std::mutex> lock(g_protect_mu);
        protected_views().erase(static_cast<char*>(data));
      }
      munmap(data, mapped + guard_bytes());  // contents read after the last release fault
      munmap(gpu, mapped + guard_bytes());
    } else if (owns) {
      free(data);  // ASan builds: contents read after the last release are a heap-use-after-free
    } else if (deallocator) {
      auto* b = static_cast<BlockLayout*>(deallocator);
      reinterpret_cast<void (*)(void*, void*, unsigned long)>(b->invoke)(b, data, length);
      block_release(deallocator);
    }
  }
  bool is_private() const { return ((options >> 4) & 0xf) == MTL::StorageModePrivate; }
};

// One view of the file: n bytes followed by an inaccessible guard page, so an access past the end of the
// page-rounded buffer always faults (without it, whether it faults depends on what the address space holds
// next: a planted off-by-one that read one row past a buffer crashed one run in many).
void* map_view(int fd, size_t n, size_t page) {
  void* r = mmap(nullptr, n + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return MAP_FAILED;
  if (mmap(r, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    munmap(r, n + page);
    return MAP_FAILED;
  }
  return r;
}

// Two mappings of one anonymous file: the CPU view and the GPU view (see Protected), each with a trailing
// guard page (unmapped with it). nullptr if unavailable.
bool map_twice(size_t length, void** cpu, void** gpu, size_t* mapped) {
  const size_t page = guard_bytes();
  const size_t n = (length + page - 1) / page * page;
  const int fd = int(syscall(SYS_memfd_create, "fakemetal-buffer", 1u /* MFD_CLOEXEC */));
  if (fd < 0) return false;
  bool ok = ftruncate(fd, off_t(n)) == 0;  // zero-filled, as Metal's new buffers are
  void* a = ok ? map_view(fd, n, page) : MAP_FAILED;
  void* b = a != MAP_FAILED ? map_view(fd, n, page) : MAP_FAILED;
  close(fd);  // the mappings keep the file alive
  if (b == MAP_FAILED) {
    if (a != MAP_FAILED) munmap(a, n + page);
    return false;
  }
  *cpu = a, *gpu = b, *mapped = n;
  return true;
}

objc_object* new_buffer(Device* dev, const void* bytes, unsigned long length, unsigned long options) {
  if (length == 0 || length > limits().max_buffer) {
    warn("newBufferWithLength: %lu bytes is not a valid buffer length (maxBufferLength %lu): returning nil", length,
         limits().max_buffer);
    return nullptr;
  }
  void* mem = nullptr;
  void* gpu = nullptr;
  size_t mapped = 0;
  if (FAKEMETAL_ASAN || !map_twice(length, &mem, &gpu, &mapped)) {
    if (posix_memalign(&mem, 256, length) != 0) return nullptr;
    memset(mem, 0, length);  // Metal zero-fills new buffers
  }
  if (bytes) memcpy(mem, bytes, length);
  if (mapped) install_segv_handler();
  Buffer* b = new_object<Buffer>(*C_buffer);
  b->set_device(dev);
  b->data = mem;
  b->gpu = gpu;
  b->mapped = mapped;
  b->length = length;
  b->options = options;
  g_allocated += length;
  return b;
}

struct CommandBuffer;
// A queue runs its committed command buffers in enqueue order on its own "GPU" thread (started on the first
// commit). Completed handlers run on one shared completion thread. FAKEMETAL_SYNC=1 runs everything inside
// commit instead (the pre-async behaviour, for debugging).
struct Queue : MtlObj {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<CommandBuffer*> order;  // enqueued, not yet started (not retained: each is retained while committed)
  uint64_t next_seq = 0, kick = 0;   // command buffers up to seq `kick` start now (someone waits on them)
  std::thread gpu;
  bool stop = false;
  bool running = false;  // the GPU thread holds a command buffer it has taken from `order`
  ~Queue();
};

// ---------------------------------------------------------------------------------------------------------
// Libraries, functions, pipelines
// ---------------------------------------------------------------------------------------------------------

struct CompileOptions : MtlObj {
  unsigned long language_version = MTL::LanguageVersion3_1;
  unsigned long math_mode = MTL::MathModeFast;  // Metal's default: fast math (fastMathEnabled = YES)
};

struct Library : MtlObj {
  const mslsim_library* lib = nullptr;
  std::string path;  // the emulator's shared object (kept on disk for sanitizer symbolization)
  unsigned long math_mode = MTL::MathModeSafe;  // as compiled (the emulator computes safe math only)
};

struct ConstantValue {
  unsigned long type = 0;  // MTL::DataType
  std::vector<uint8_t> bytes;
};

struct ConstantValues : MtlObj {
  std::vector<std::pair<unsigned long, ConstantValue>> by_index;
  std::vector<std::pair<std::string, ConstantValue>> by_name;
};

struct Function : MtlObj {
  Library* library = nullptr;  // held
  const mslsim_kernel* kernel = nullptr;
  objc_object* name = nullptr;
  std::vector<std::pair<int, std::vector<uint8_t>>> constants;  // index -> value bytes
  ~Function() {
    release(name);
    release(library);
  }
};

struct Pipeline : MtlObj {
  Function* function = nullptr;  // held
  size_t static_tg = 0;          // staticThreadgroupMemoryLength
  ~Pipeline() { release(function); }
};

// MTL::DataType -> (bytes, MSL type name) for the function constant types the emulator knows.
bool data_type_info(unsigned long t, size_t* size, const char** msl) {
  switch (t) {
    case MTL::DataTypeBool: *size = 1; *msl = "bool"; return true;
    case MTL::DataTypeChar: *size = 1; *msl = "char"; return true;
    case MTL::DataTypeUChar: *size = 1; *msl = "uchar"; return true;
    case MTL::DataTypeShort: *size = 2; *msl = "short"; return true;
    case MTL::DataTypeUShort: *size = 2; *msl = "ushort"; return true;
    case MTL::DataTypeHalf: *size = 2; *msl = "half"; return true;
    case MTL::DataTypeBFloat: *size = 2; *msl = "bfloat"; return true;
    case MTL::DataTypeInt: *size = 4; *msl = "int"; return true;
    case MTL::DataTypeUInt: *size = 4; *msl = "uint"; return true;
    case MTL::DataTypeFloat: *size = 4; *msl = "float"; return true;
    case MTL::DataTypeLong: *size = 8; *msl = "long"; return true;
    case MTL::DataTypeULong: *size = 8; *msl = "ulong"; return true;
    default: return false;
  }
}

std::string normalize_msl_type(std::string t) {
  for (const char* q : {"const ", "constant ", "metal::"}) {
    size_t at;
    while ((at = t.find(q)) != std::string::npos) t.erase(at, strlen(q));
  }
  while (!t.empty() && t.back() == ' ') t.pop_back();
  while (!t.empty() && t.front() == ' ') t.erase(0, 1);
  static const std::pair<const char*, const char*> aliases[] = {
      {"unsigned int", "uint"}, {"uint32_t", "uint"}, {"int32_t", "int"}, {"unsigned short", "ushort"},
      {"uint16_t", "ushort"}, {"int16_t", "short"}, {"unsigned char", "uchar"}, {"uint8_t", "uchar"},
      {"int8_t", "char"}, {"uint64_t", "ulong"}, {"int64_t", "long"}, {"size_t", "ulong"},
      {"unsigned long", "ulong"}, {"bfloat16_t", "bfloat"}, {"half_t", "half"}};
  for (auto& [from, to] : aliases)
    if (t == from) return to;
  return t;
}

// ---------------------------------------------------------------------------------------------------------
// Command buffers and encoders
// ---------------------------------------------------------------------------------------------------------

struct Binding {
  Buffer* buffer = nullptr;  // held by a recorded command when the command buffer retains references
  size_t offset = 0;
  std::shared_ptr<std::vector<uint8_t>> bytes;  // setBytes: copied when set, as Metal does
  bool set = false;
};

struct Command {
  // Barrier: memoryBarrierWithResources inside a concurrent stage; it orders only the listed buffers.
  enum Kind { Dispatch, Copy, Fill, Barrier } kind = Dispatch;
  std::vector<const void*> resources;  // Barrier: the listed resources (identity only, not retained)
  int ordinal = 0;  // position within its encoder (for messages)
  // Dispatch
  Pipeline* pipeline = nullptr;
  std::array<Binding, kMaxBindings> bind{};
  std::array<size_t, kMaxBindings> threadgroup_bytes{};
  uint32_t groups[3] = {0, 0, 0}, threads[3] = {0, 0, 0}, grid[3] = {0, 0, 0};
  bool by_threads = false;  // dispatchThreads (grid in threads, edge threadgroups partial)
  // Copy / Fill
  Buffer* src = nullptr;
  Buffer* dst = nullptr;
  size_t src_offset = 0, dst_offset = 0, size = 0;
  uint8_t value = 0;
};

struct CommandBuffer;

// What one encoder recorded. The command buffer owns it; the encoder object (autoreleased, +0 to the caller,
// as in Metal) only points to it, so an encoder used after its autorelease pool drained is a use-after-release.
struct Recording {
  CommandBuffer* owner = nullptr;  // cleared when the command buffer goes away
  bool compute = true;
  bool concurrent = false;
  bool ended = false;
  int commands = 0;
  // Compute argument table (persists across dispatches, as in Metal)
  Pipeline* pipeline = nullptr;
  std::array<Binding, kMaxBindings> bind{};
  std::array<size_t, kMaxBindings> threadgroup_bytes{};
  std::vector<std::vector<Command>> stages{1};
  bool retain_refs = true;
  ~Recording();
  const char* kind() const { return compute ? "MTLComputeCommandEncoder" : "MTLBlitCommandEncoder"; }
  void check_open(const char* what) const {
    if (ended) die("-[%s %s] after endEncoding", kind(), what);
  }
  void hold(Command& c) {
    if (!retain_refs) return;
    retain(c.pipeline);
    for (auto& b : c.bind) retain(b.buffer);
    retain(c.src);
    retain(c.dst);
  }
};

struct Encoder : MtlObj {
  std::shared_ptr<Recording> rec;
  ~Encoder() {
    if (rec && !rec->ended)
      die("%s %p: Command encoder released without endEncoding (an encoder is autoreleased: retain it to use "
          "it beyond its autorelease pool)", rec->kind(), static_cast<void*>(this));
  }
};

void drop(Command& c, bool held) {
  if (!held) return;
  release(c.pipeline);
  for (auto& b : c.bind) release(b.buffer);
  release(c.src);
  release(c.dst);
  c.pipeline = nullptr;
  c.src = c.dst = nullptr;
  for (auto& b : c.bind) b.buffer = nullptr;
}

Recording::~Recording() {
  for (auto& stage : stages)
    for (auto& c : stage) drop(c, retain_refs);
}

struct CommandBuffer : MtlObj {
  objc_object* queue = nullptr;  // held
  bool retain_refs = true;
  std::atomic<unsigned long> status{MTL::CommandBufferStatusNotEnqueued};
  uint64_t seq = 0;              // position in its queue's enqueue order
  bool failed = false;           // set while running; the status becomes Error when it completes
  std::mutex mu;                 // guards status changes for waiters
  std::condition_variable cv;
  std::vector<std::pair<char*, bool>> guarded;  // CPU views protected while in flight (view, may write)
  double commit_time = 0;
  objc_object* error = nullptr;  // held
  std::vector<std::shared_ptr<Recording>> encoders;
  Recording* open = nullptr;
  std::vector<void*> scheduled_handlers, completed_handlers;  // copied blocks
  double start_time = 0, end_time = 0;
  ~CommandBuffer() {
    if (open) die("MTLCommandBuffer %p released while an encoder is open (call endEncoding)", static_cast<void*>(this));
    for (auto& r : encoders) r->owner = nullptr;
    for (void* b : scheduled_handlers) block_release(b);
    for (void* b : completed_handlers) block_release(b);
    release(error);
    release(queue);
  }
};

// Runs every recorded command; the command buffer ends Completed or Error.
std::mutex g_execute_mu;  // one command buffer executes at a time

bool fail(CommandBuffer* cb, long code, const std::string& what) {
  cb->error = make_error("MTLCommandBufferErrorDomain", code, "fakemetal: " + what);
  cb->failed = true;
  return false;
}

std::string describe_cb(const CommandBuffer* cb) {
  const std::string label = string_value(cb->label);
  char buf[64];
  snprintf(buf, sizeof buf, "%p", static_cast<const void*>(cb));
  return label.empty() ? std::string("<unlabelled MTLCommandBuffer ") + buf + ">" : "'" + label + "'";
}
std::string describe_buffer(const Buffer* b) {
  const std::string label = string_value(b->label);
  char buf[96];
  snprintf(buf, sizeof buf, "<unlabelled MTLBuffer %p, %zu bytes>", static_cast<const void*>(b), b->length);
  return label.empty() ? std::string(buf) : "'" + label + "'";
}

std::string describe_command(const Recording* e, size_t encoder_index, size_t stage, const Command& c) {
  std::ostringstream s;
  s << "encoder " << encoder_index << " (" << (e->concurrent ? "concurrent" : "serial") << "), stage " << stage
    << ", command " << c.ordinal;
  if (c.kind == Command::Dispatch && c.pipeline && c.pipeline->function)
    s << " (kernel '" << c.pipeline->function->kernel->name << "')";
  return s.str();
}

bool buffer_usable(CommandBuffer* cb, const Buffer* b, const std::string& where, const char* what) {
  if (!is_live_object(b))
    return fail(cb, MTL::CommandBufferErrorInvalidResource,
                where + ": " + what + " was released before the command buffer ran (unretained references)");
  return true;
}

// A bool function constant that enables optional arguments: set and nonzero in the pipeline's function.
bool constant_enabled(const Function* fn, int index) {
  for (const auto& [i, bytes] : fn->constants)
    if (i == index) return std::any_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b != 0; });
  return false;
}

// ---- device-memory traffic (FAKEMETAL_TRAFFIC=<file>) ----------------------------------------------------------
// In a traffic-mode build every load and store of the kernels reaches libmslsim, which reports per dispatch the
// distinct bytes of the bound buffers read and written (mslsim_dispatch::traffic). Here each byte is credited to
// one buffer binding (the one bound at the greatest offset at or below it: two bindings of one buffer do not count
// a byte twice), setBytes data (the argument table, not device memory) is left out, and each command buffer keeps
// the union over its dispatches per buffer. Written bytes are checked against what changed: a byte whose value
// changed but that no counted store wrote fails the command buffer (an access the instrumentation missed).
// Output, one JSON object per line:
//   {"type": "dispatch", "cb": N, "label": L, "stage": S, "command": C, "kernel": K, "read": R, "written": W,
//    "accessed_read": AR, "accessed_written": AW, "bindings": [{"index": I, "buffer": B, "id": ID, "read": r,
//    "written": w}, ...]}                       R, W: distinct bytes; AR, AW: bytes of all accesses (re-reads too)
//   {"type": "command_buffer", "cb": N, "label": L, "dispatches": D, "stages": S,
//    "buffers": [{"buffer": B, "id": ID, "length": len, "read": [[begin, end], ...], "written": [...]}, ...]}
//                                               the union of the dispatches' bytes, as buffer-relative ranges
const char* traffic_path() {
  static const char* p = [] {
    const char* v = getenv("FAKEMETAL_TRAFFIC");
    if (v && *v && strcmp(FAKEMETAL_MODE, "traffic") != 0)
      die("FAKEMETAL_TRAFFIC needs the traffic build of the fake runtime (metalsim.host.build_program(..., "
          "\"traffic\", ...)); this one is %s", FAKEMETAL_MODE);
    return v && *v ? v : nullptr;
  }();
  return p;
}

struct TrafficRuns {
  std::vector<std::pair<uintptr_t, uintptr_t>> runs[2];  // [write]: [begin, end) absolute, in address order
  uint64_t accessed[2] = {0, 0};
};
void on_traffic(void* ctx, const void* a, size_t n, int write) {
  auto* t = static_cast<TrafficRuns*>(ctx);
  if (!a)
    t->accessed[write] += n;
  else
    t->runs[write].push_back({uintptr_t(a), uintptr_t(a) + n});
}

// Buffer-relative byte ranges, kept merged.
struct IntervalSet {
  std::map<size_t, size_t> r;  // begin -> end
  void add(size_t b, size_t e) {
    auto it = r.upper_bound(b);
    if (it != r.begin() && std::prev(it)->second >= b) {
      --it;
      b = it->first;
      e = std::max(e, it->second);
      it = r.erase(it);
    }
    while (it != r.end() && it->first <= e) {
      e = std::max(e, it->second);
      it = r.erase(it);
    }
    r[b] = e;
  }
};

struct BufferTraffic {
  std::string label;
  size_t length = 0;
  IntervalSet ranges[2];
};

struct CbTraffic {
  std::map<const Buffer*, BufferTraffic> buffers;
  std::string lines;
  int dispatches = 0;
};

std::string json_string(const std::string& v) {
  std::string o = "\"";
  for (char ch : v) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (uint8_t(ch) < 0x20) continue;
    o += ch;
  }
  return o + "\"";
}
std::string buffer_id(const Buffer* b) {
  char buf[32];
  snprintf(buf, sizeof buf, "\"%p\"", static_cast<const void*>(b));
  return buf;
}

// Credits the dispatch's runs to its buffer bindings, checks its writes, and records it. False: a changed byte
// was not counted (the command buffer fails).
bool account_traffic(CommandBuffer* cb, const std::string& where, const Command& c, size_t stage,
                     const TrafficRuns& t, const std::vector<std::vector<uint8_t>>& before, CbTraffic& out);

bool run_dispatch(CommandBuffer* cb, const std::string& where, const Command& c, bool reverse, uint64_t seed,
                  uint64_t order_seed, TrafficRuns* traffic = nullptr) {
  if (!c.pipeline) return fail(cb, MTL::CommandBufferErrorInvalidResource, where + ": no compute pipeline state set");
  const Function* fn = c.pipeline->function;
  const mslsim_kernel* k = fn->kernel;
  mslsim_dispatch d;
  memset(&d, 0, sizeof d);
  d.library = fn->library->lib;
  d.kernel = k;
  for (int i = 0; i < kMaxBindings; ++i) {
    const Binding& b = c.bind[i];
    if (!b.set) continue;
    if (b.bytes) {
      d.buffers[i] = b.bytes->data();
      d.buffer_bytes[i] = b.bytes->size();
      continue;
    }
    if (!buffer_usable(cb, b.buffer, where, ("the buffer at index " + std::to_string(i)).c_str())) return false;
    if (b.offset > b.buffer->length)
      return fail(cb, MTL::CommandBufferErrorInvalidResource,
                  where + ": buffer(" + std::to_string(i) + ") offset " + std::to_string(b.offset) +
                      " is past the buffer's " + std::to_string(b.buffer->length) + " bytes");
    d.buffers[i] = b.buffer->gpu_data() + b.offset;
    d.buffer_bytes[i] = b.buffer->length - b.offset;
  }
  size_t threadgroup_total = c.pipeline->static_tg;  // static + the lengths of the kernel's [[threadgroup(i)]]
  for (int i = 0; i < kMaxBindings; ++i) d.threadgroup_bytes[i] = c.threadgroup_bytes[i];
  for (int a = 0; a < k->n_args; ++a) {
    const mslsim_arg& arg = k->args[a];
    if (arg.enabled_by_constant >= 0 && !constant_enabled(fn, arg.enabled_by_constant))
      continue;  // [[buffer(i), function_constant(c)]] with c false: the argument does not exist
    const std::string label = std::string(arg.kind == MSLSIM_ARG_BUFFER ? "[[buffer(" : "[[threadgroup(") +
                              std::to_string(arg.index) + ")]] '" + (arg.name ? arg.name : "?") + "' (" +
                              (arg.type ? arg.type : "?") + ")";
    if (arg.index < 0 || arg.index >= kMaxBindings)
      return fail(cb, MTL::CommandBufferErrorInternal, where + ": " + label + " has an index out of range");
    if (arg.kind == MSLSIM_ARG_BUFFER) {
      if (!c.bind[arg.index].set)
        return fail(cb, MTL::CommandBufferErrorInvalidResource, where + ": " + label + " is not bound");
      if (arg.min_bytes && d.buffer_bytes[arg.index] < arg.min_bytes)
        return fail(cb, MTL::CommandBufferErrorInvalidResource,
                    where + ": " + label + " is bound to " + std::to_string(d.buffer_bytes[arg.index]) +
                        " bytes; the kernel needs at least " + std::to_string(arg.min_bytes));
    } else if (arg.kind == MSLSIM_ARG_THREADGROUP) {
      if (c.threadgroup_bytes[arg.index] < std::max<size_t>(arg.min_bytes, 1))
        return fail(cb, MTL::CommandBufferErrorInvalidResource,
                    where + ": " + label + " has " + std::to_string(c.threadgroup_bytes[arg.index]) +
                        " bytes of threadgroup memory (setThreadgroupMemoryLength:atIndex:)");
      threadgroup_total += c.threadgroup_bytes[arg.index];
    }
  }
  if (threadgroup_total > limits().max_tg_memory)
    return fail(cb, MTL::CommandBufferErrorInvalidResource,
                where + ": " + std::to_string(threadgroup_total) + " bytes of threadgroup memory (" +
                    std::to_string(c.pipeline->static_tg) + " static + " +
                    std::to_string(threadgroup_total - c.pipeline->static_tg) +
                    " set with setThreadgroupMemoryLength) exceed the device's " +
                    std::to_string(limits().max_tg_memory) + "-byte limit");
  const uint64_t per_group = uint64_t(c.threads[0]) * c.threads[1] * c.threads[2];
  if (per_group == 0 || per_group > limits().max_threads)
    return fail(cb, MTL::CommandBufferErrorInvalidResource,
                where + ": " + std::to_string(per_group) + " threads per threadgroup (the pipeline's "
                "maxTotalThreadsPerThreadgroup allows 1 to " + std::to_string(limits().max_threads) + ")");
  for (int i = 0; i < 3; ++i) {
    d.threads_per_threadgroup[i] = c.threads[i];
    if (c.by_threads) {
      d.grid_threads[i] = c.grid[i];
      d.threadgroups[i] = (c.grid[i] + c.threads[i] - 1) / c.threads[i];
    } else {
      d.threadgroups[i] = c.groups[i];
    }
  }
  if (uint64_t(d.threadgroups[0]) * d.threadgroups[1] * d.threadgroups[2] == 0) return true;  // empty grid
  std::vector<mslsim_constant_value> constants;
  for (const auto& [index, bytes] : fn->constants) constants.push_back({index, bytes.data(), bytes.size()});
  d.constants = constants.data();
  d.n_constants = int(constants.size());
  d.execution_width = uint32_t(kThreadExecutionWidth);
  d.lane_shuffle_seed = seed;
  d.reverse_threadgroups = reverse ? 1 : 0;
  d.threadgroup_order_seed = order_seed;
  d.max_threads_per_threadgroup = uint32_t(limits().max_threads);
  d.max_threadgroup_memory = limits().max_tg_memory;
  if (traffic) {
    d.traffic = &on_traffic;
    d.traffic_ctx = traffic;
  }
  char err[2048] = {0};
  g_running_dispatch.store(where.c_str());
  const int rc = mslsim_run(&d, err, sizeof err);
  g_running_dispatch.store(nullptr);
  if (rc != 0)
    return fail(cb, MTL::CommandBufferErrorInternal, where + ": " + (err[0] ? err : "kernel failed"));
  return true;
}

bool run_copy(CommandBuffer* cb, const std::string& where, const Command& c) {
  if (!buffer_usable(cb, c.src, where, "the source buffer") ||
      !buffer_usable(cb, c.dst, where, "the destination buffer"))
    return false;
  if (c.src_offset + c.size > c.src->length || c.dst_offset + c.size > c.dst->length)
    return fail(cb, MTL::CommandBufferErrorInvalidResource, where + ": copy of " + std::to_string(c.size) +
                                                                " bytes runs past the end of a buffer");
  memmove(c.dst->gpu_data() + c.dst_offset, c.src->gpu_data() + c.src_offset, c.size);
  return true;
}

bool run_fill(CommandBuffer* cb, const std::string& where, const Command& c) {
  if (!buffer_usable(cb, c.dst, where, "the buffer")) return false;
  if (c.dst_offset + c.size > c.dst->length)
    return fail(cb, MTL::CommandBufferErrorInvalidResource, where + ": fill runs past the end of the buffer");
  memset(c.dst->gpu_data() + c.dst_offset, c.value, c.size);
  return true;
}

void call_handlers(CommandBuffer* cb, std::vector<void*>& handlers) {
  for (void* h : handlers) {
    auto* b = static_cast<BlockLayout*>(h);
    reinterpret_cast<void (*)(void*, objc_object*)>(b->invoke)(b, cb);
    block_release(h);
  }
  handlers.clear();
}

uint64_t mix(uint64_t x) {  // splitmix64 finaliser: independent seeds per stage and dispatch
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void set_status(CommandBuffer* cb, unsigned long st) {
  std::lock_guard<std::mutex> lock(cb->mu);
  cb->status = st;
  cb->cv.notify_all();
}

// ---- ordering within a concurrent stage and the hazard check ------------------------------------------------
// Within a stage (between full barriers) dispatches may run in any order, except that a resource barrier
// orders the dispatches before it that bind one of its resources before the dispatches after it that bind
// one. The stage runs in a valid order that is as adversarial as asked: recorded order, the reverse of it
// (FAKEMETAL_REVERSE: the latest ready dispatch first), or seeded random choices (FAKEMETAL_ORDER_SEED).

const Buffer* bound(const Command& c, int index) { return c.bind[index].bytes ? nullptr : c.bind[index].buffer; }

bool binds(const Command& c, const void* r) {
  if (c.kind == Command::Dispatch) {
    for (int i = 0; i < kMaxBindings; ++i)
      if (c.bind[i].set && bound(c, i) == r) return true;
    return false;
  }
  return c.src == r || c.dst == r;
}

// Whether a resource barrier between commands i < j orders them for resource r (nullptr: for any shared one).
bool ordered(const std::vector<Command>& stage, size_t i, size_t j, const void* r) {
  for (size_t b = i + 1; b < j; ++b) {
    if (stage[b].kind != Command::Barrier) continue;
    for (const void* x : stage[b].resources)
      if ((r ? x == r : true) && binds(stage[i], x) && binds(stage[j], x)) return true;
  }
  return false;
}

std::vector<size_t> stage_order(const std::vector<Command>& stage, bool reverse, uint64_t rng) {
  const size_t n = stage.size();
  std::vector<size_t> order;
  std::vector<bool> done(n, false);
  while (order.size() < n) {
    std::vector<size_t> ready;
    for (size_t j = 0; j < n; ++j) {
      if (done[j]) continue;
      bool ok = true;
      for (size_t i = 0; i < j && ok; ++i)
        if (!done[i] && ordered(stage, i, j, nullptr)) ok = false;
      if (ok) ready.push_back(j);
    }
    const size_t pick = rng ? ready[(rng = mix(rng)) % ready.size()] : reverse ? ready.back() : ready.front();
    done[pick] = true;
    order.push_back(pick);
  }
  return order;
}

// What one command did to the buffers it binds: byte ranges it wrote (observed: the bytes that changed) and
// ranges it may read (declared: from the binding's offset to the end, or the referenced object's size).
struct Range {
  const Buffer* buffer;
  size_t begin, end;
  int binding;  // the argument index (-1 for blit source / destination)
};
struct Access {
  std::vector<Range> writes, reads;
};

// The writable bindings' bytes before the command runs (kernel arguments with writes = 1, blit destinations).
std::vector<std::vector<uint8_t>> snapshot(const Command& c) {
  std::vector<std::vector<uint8_t>> out(kMaxBindings + 1);
  if (c.kind == Command::Dispatch) {
    const mslsim_kernel* k = c.pipeline ? c.pipeline->function->kernel : nullptr;
    for (int a = 0; k && a < k->n_args; ++a) {
      const mslsim_arg& arg = k->args[a];
      if (arg.kind != MSLSIM_ARG_BUFFER || !arg.writes || arg.index < 0 || arg.index >= kMaxBindings) continue;
      const Buffer* b = bound(c, arg.index);
      if (b && is_live_object(b) && c.bind[arg.index].offset < b->length)
        out[arg.index].assign(b->gpu_data() + c.bind[arg.index].offset, b->gpu_data() + b->length);
    }
  } else if (c.dst && is_live_object(c.dst) && c.dst_offset + c.size <= c.dst->length) {
    out[kMaxBindings].assign(c.dst->gpu_data() + c.dst_offset, c.dst->gpu_data() + c.dst_offset + c.size);
  }
  return out;
}

void changed_ranges(const Buffer* b, size_t base, const std::vector<uint8_t>& old, int binding, std::vector<Range>& out) {
  const char* now = b->gpu_data() + base;
  size_t i = 0;
  while (i < old.size()) {
    if (uint8_t(now[i]) == old[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < old.size() && uint8_t(now[j]) != old[j]) ++j;
    // Whole 4-byte words: a stored float whose low bytes did not change still wrote them.
    i &= ~size_t(3);
    j = std::min(old.size(), (j + 3) & ~size_t(3));
    if (!out.empty() && out.back().buffer == b && out.back().end + 64 >= base + i)
      out.back().end = base + j;  // merge nearby runs: a range per written region, not per byte
    else
      out.push_back(Range{b, base + i, base + j, binding});
    i = j;
  }
}

Access observe(const Command& c, const std::vector<std::vector<uint8_t>>& before) {
  Access a;
  if (c.kind == Command::Dispatch) {
    const mslsim_kernel* k = c.pipeline->function->kernel;
    for (int x = 0; x < k->n_args; ++x) {
      const mslsim_arg& arg = k->args[x];
      if (arg.kind != MSLSIM_ARG_BUFFER || arg.index < 0 || arg.index >= kMaxBindings) continue;
      const Buffer* b = bound(c, arg.index);
      if (!b || !is_live_object(b)) continue;
      const size_t off = c.bind[arg.index].offset;
      if (arg.writes)
        changed_ranges(b, off, before[arg.index], arg.index, a.writes);
      else
        a.reads.push_back(Range{b, off, arg.min_bytes ? std::min(b->length, off + arg.min_bytes) : b->length,
                                arg.index});
    }
  } else {
    if (c.dst) changed_ranges(c.dst, c.dst_offset, before[kMaxBindings], -1, a.writes);
    if (c.src) a.reads.push_back(Range{c.src, c.src_offset, c.src_offset + c.size, -1});
  }
  return a;
}

bool account_traffic(CommandBuffer* cb, const std::string& where, const Command& c, size_t stage,
                     const TrafficRuns& t, const std::vector<std::vector<uint8_t>>& before, CbTraffic& out) {
  struct Bound {
    int index;
    const Buffer* b;
    uintptr_t begin, end;
  };
  std::vector<Bound> bound_to;
  std::vector<uintptr_t> cuts;
  for (int i = 0; i < kMaxBindings; ++i) {
    const Binding& x = c.bind[i];
    if (!x.set || x.bytes || !x.buffer) continue;
    const uintptr_t base = uintptr_t(x.buffer->gpu_data());
    bound_to.push_back({i, x.buffer, base + x.offset, base + x.buffer->length});
    cuts.push_back(base + x.offset);
    cuts.push_back(base + x.buffer->length);
  }
  std::sort(cuts.begin(), cuts.end());
  uint64_t per[kMaxBindings][2] = {};
  uint64_t total[2] = {0, 0};
  for (int k = 0; k < 2; ++k)
    for (auto [a, e] : t.runs[k])
      for (uintptr_t x = a; x < e;) {
        const auto next = std::upper_bound(cuts.begin(), cuts.end(), x);
        const uintptr_t y = next == cuts.end() ? e : std::min(e, *next);
        const Bound* best = nullptr;
        for (const Bound& bd : bound_to)
          if (bd.begin <= x && x < bd.end && (!best || bd.begin > best->begin)) best = &bd;
        if (best) {  // else: setBytes data (the argument table)
          per[best->index][k] += y - x;
          total[k] += y - x;
          BufferTraffic& bt = out.buffers[best->b];
          if (bt.label.empty()) bt.label = string_value(best->b->label), bt.length = best->b->length;
          const uintptr_t base = uintptr_t(best->b->gpu_data());
          bt.ranges[k].add(x - base, y - base);
        }
        x = y;
      }
  // Every byte that changed must lie in a counted write.
  const auto& w = t.runs[1];
  const mslsim_kernel* kern = c.pipeline->function->kernel;
  for (int a = 0; a < kern->n_args; ++a) {
    const mslsim_arg& arg = kern->args[a];
    if (arg.kind != MSLSIM_ARG_BUFFER || !arg.writes || arg.index < 0 || arg.index >= kMaxBindings) continue;
    const Buffer* b = bound(c, arg.index);
    if (!b || before[arg.index].empty()) continue;
    const uint8_t* now = reinterpret_cast<const uint8_t*>(b->gpu_data() + c.bind[arg.index].offset);
    const uintptr_t base = uintptr_t(now);
    for (size_t i = 0; i < before[arg.index].size(); ++i) {
      if (now[i] == before[arg.index][i]) continue;
      const uintptr_t x = base + i;
      auto it = std::upper_bound(w.begin(), w.end(), std::make_pair(x, ~uintptr_t(0)));
      if (it == w.begin() || std::prev(it)->second <= x)
        return fail(cb, MTL::CommandBufferErrorInternal,
                    where + ": traffic: byte " + std::to_string(c.bind[arg.index].offset + i) + " of buffer " +
                        describe_buffer(b) + " changed through buffer(" + std::to_string(arg.index) +
                        ") but no counted store wrote it (an access the instrumentation missed)");
    }
  }
  std::ostringstream o;
  o << "{\"type\": \"dispatch\", \"cb\": " << cb->seq << ", \"label\": " << json_string(string_value(cb->label))
    << ", \"stage\": " << stage << ", \"command\": " << c.ordinal << ", \"kernel\": " << json_string(kern->name)
    << ", \"read\": " << total[0] << ", \"written\": " << total[1] << ", \"accessed_read\": " << t.accessed[0]
    << ", \"accessed_written\": " << t.accessed[1] << ", \"bindings\": [";
  bool first = true;
  for (const Bound& bd : bound_to) {
    o << (first ? "" : ", ") << "{\"index\": " << bd.index << ", \"buffer\": " << json_string(string_value(bd.b->label))
      << ", \"id\": " << buffer_id(bd.b) << ", \"read\": " << per[bd.index][0] << ", \"written\": " << per[bd.index][1]
      << "}";
    first = false;
  }
  o << "]}\n";
  out.lines += o.str();
  ++out.dispatches;
  return true;
}

void write_traffic(CommandBuffer* cb, const Recording* enc_unused, size_t stages, CbTraffic& t) {
  (void)enc_unused;
  std::ostringstream o;
  o << "{\"type\": \"command_buffer\", \"cb\": " << cb->seq << ", \"label\": " << json_string(string_value(cb->label))
    << ", \"dispatches\": " << t.dispatches << ", \"stages\": " << stages << ", \"buffers\": [";
  bool first = true;
  for (auto& [b, bt] : t.buffers) {
    o << (first ? "" : ", ") << "{\"buffer\": " << json_string(bt.label) << ", \"id\": " << buffer_id(b)
      << ", \"length\": " << bt.length;
    for (int k = 0; k < 2; ++k) {
      o << (k ? ", \"written\": [" : ", \"read\": [");
      bool f2 = true;
      for (auto [x, y] : bt.ranges[k].r) {
        o << (f2 ? "" : ", ") << "[" << x << ", " << y << "]";
        f2 = false;
      }
      o << "]";
    }
    o << "}";
    first = false;
  }
  o << "]}\n";
  t.lines += o.str();
  FILE* f = fopen(traffic_path(), "a");
  if (!f) die("FAKEMETAL_TRAFFIC: cannot open %s: %s", traffic_path(), strerror(errno));
  fwrite(t.lines.data(), 1, t.lines.size(), f);
  fclose(f);
}

std::string describe_range(const Command& c, const Range& r, const char* how) {
  std::ostringstream s;
  s << "command " << c.ordinal;
  if (c.kind == Command::Dispatch) s << " (kernel '" << c.pipeline->function->kernel->name << "')";
  s << " " << how << " bytes [" << r.begin << ", " << r.end << ")";
  if (r.binding >= 0) s << " through buffer(" << r.binding << ")";
  return s.str();
}

// Two commands of one stage that no barrier orders must not touch overlapping bytes of a buffer where one
// of them writes: on the GPU they may run at the same time, in either order.
bool check_hazards(CommandBuffer* cb, const Recording* enc, size_t e, size_t s, const std::vector<Command>& stage,
                   const std::vector<Access>& access) {
  for (size_t i = 0; i < stage.size(); ++i)
    for (size_t j = i + 1; j < stage.size(); ++j) {
      if (stage[i].kind == Command::Barrier || stage[j].kind == Command::Barrier) continue;
      auto conflict = [&](const std::vector<Range>& x, const std::vector<Range>& y, const char* hx,
                          const char* hy) -> bool {
        for (const Range& a : x)
          for (const Range& b : y) {
            if (a.buffer != b.buffer || a.end <= b.begin || b.end <= a.begin) continue;
            if (ordered(stage, i, j, a.buffer)) continue;
            std::ostringstream m;
            m << "hazard in encoder " << e << " (" << (enc->concurrent ? "concurrent" : "serial") << "), stage " << s
              << ": " << describe_range(stage[i], a, hx) << " and " << describe_range(stage[j], b, hy)
              << " of buffer " << describe_buffer(a.buffer)
              << " overlap with no memory barrier between them (they may run at the same time)";
            fail(cb, MTL::CommandBufferErrorInvalidResource, m.str());
            return true;
          }
        return false;
      };
      if (conflict(access[i].writes, access[j].writes, "writes", "writes") ||
          conflict(access[i].writes, access[j].reads, "writes", "may read") ||
          conflict(access[i].reads, access[j].writes, "may read", "writes"))
        return false;
    }
  return true;
}

// Runs the recorded commands (on the queue's GPU thread, or in commit with FAKEMETAL_SYNC=1).
void execute(CommandBuffer* cb) {
  std::lock_guard<std::mutex> lock(g_execute_mu);
  const bool reverse = env_flag("FAKEMETAL_REVERSE");
  const uint64_t seed = env_u64("FAKEMETAL_SHUFFLE", 0);
  const uint64_t order_seed = env_u64("FAKEMETAL_ORDER_SEED", 0);
  const bool hazards = !getenv("FAKEMETAL_HAZARDS") || env_flag("FAKEMETAL_HAZARDS");
  set_status(cb, MTL::CommandBufferStatusScheduled);
  call_handlers(cb, cb->scheduled_handlers);
  cb->start_time = now_seconds();
  bool ok = true;
  const bool traffic = traffic_path() != nullptr;
  CbTraffic cb_traffic;
  size_t stages_run = 0;  // stages holding at least one command (the traffic record)
  for (size_t e = 0; ok && e < cb->encoders.size(); ++e) {
    Recording* enc = cb->encoders[e].get();
    for (size_t s = 0; ok && s < enc->stages.size(); ++s) {
      std::vector<Command>& stage = enc->stages[s];
      const std::vector<size_t> order = stage_order(stage, reverse, order_seed ? mix(order_seed ^ (e << 40) ^ s) : 0);
      const bool check = hazards && stage.size() > 1;
      std::vector<Access> access(check ? stage.size() : 0);
      bool any = false;
      for (size_t i : order) {
        const Command& c = stage[i];
        if (c.kind == Command::Barrier) continue;
        any = true;
        const std::string where = describe_command(enc, e, s, c);
        const uint64_t tg_seed = order_seed ? mix(order_seed ^ (e << 40) ^ (s << 20) ^ i) | 1 : 0;
        std::vector<std::vector<uint8_t>> before;
        const bool count = traffic && c.kind == Command::Dispatch;
        if (check || count) before = snapshot(c);
        TrafficRuns runs;
        ok = c.kind == Command::Dispatch ? run_dispatch(cb, where, c, reverse, seed, tg_seed, count ? &runs : nullptr)
             : c.kind == Command::Copy   ? run_copy(cb, where, c)
                                         : run_fill(cb, where, c);
        if (ok && count) ok = account_traffic(cb, where, c, stages_run, runs, before, cb_traffic);
        if (!ok) break;
        if (check) access[i] = observe(c, before);
      }
      stages_run += any ? 1 : 0;
      if (ok && check) ok = check_hazards(cb, enc, e, s, stage, access);
    }
  }
  if (ok && traffic) write_traffic(cb, nullptr, stages_run, cb_traffic);
  // Work is done: the command buffer lets go of the resources it referenced.
  for (auto& enc : cb->encoders) {
    for (auto& stage : enc->stages)
      for (auto& c : stage) drop(c, enc->retain_refs);
    enc->stages.clear();
  }
  cb->end_time = now_seconds();
}

// The CPU views of the shared buffers a command buffer binds, protected from commit to completion.
void guard_buffers(CommandBuffer* cb) {
  std::map<Buffer*, bool> uses;  // buffer -> may the work write it
  auto use = [&](Buffer* b, bool writes) {
    if (b && is_live_object(b) && b->mapped && !b->is_private()) uses[b] = uses[b] || writes;
  };
  for (auto& enc : cb->encoders)
    for (auto& stage : enc->stages)
      for (auto& c : stage) {
        use(c.src, false);
        use(c.dst, true);
        if (c.kind != Command::Dispatch || !c.pipeline) continue;
        const mslsim_kernel* k = c.pipeline->function->kernel;
        for (int a = 0; a < k->n_args; ++a)
          if (k->args[a].kind == MSLSIM_ARG_BUFFER && k->args[a].index >= 0 && k->args[a].index < kMaxBindings)
            use(c.bind[k->args[a].index].buffer, k->args[a].writes != 0);
      }
  std::lock_guard<std::mutex> lock(g_protect_mu);
  for (auto& [b, writes] : uses) {
    char* view = static_cast<char*>(b->data);
    Protected& p = protected_views()[view];
    p.length = b->mapped;
    p.buffer = describe_buffer(b);
    (writes ? p.writers : p.readers)++;
    p.users.push_back(describe_cb(cb));
    apply_protection(view, p);
    cb->guarded.emplace_back(view, writes);
  }
}

void unguard_buffers(CommandBuffer* cb) {
  std::lock_guard<std::mutex> lock(g_protect_mu);
  const std::string me = describe_cb(cb);
  for (auto& [view, writes] : cb->guarded) {
    auto it = protected_views().find(view);
    if (it == protected_views().end()) continue;  // released while in flight (unretained references)
    Protected& p = it->second;
    (writes ? p.writers : p.readers)--;
    auto u = std::find(p.users.begin(), p.users.end(), me);
    if (u != p.users.end()) p.users.erase(u);
    apply_protection(view, p);
  }
  cb->guarded.clear();
}

// Completed handlers run on one thread, in completion order; the handler thread drops the reference commit took.
struct Completions {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<CommandBuffer*> ready;
  int busy = 0;
  std::thread thread;
};
Completions& completions() {
  static auto* c = new Completions;  // never destroyed: the thread may be parked in it at exit
  return *c;
}
void completion_main() {
  Completions& c = completions();
  for (;;) {
    CommandBuffer* cb;
    {
      std::unique_lock<std::mutex> lock(c.mu);
      c.cv.wait(lock, [&] { return !c.ready.empty(); });
      cb = c.ready.front();
      c.ready.pop_front();
    }
    call_handlers(cb, cb->completed_handlers);
    release(cb);
    std::lock_guard<std::mutex> lock(c.mu);
    if (--c.busy == 0) c.cv.notify_all();
  }
}

// The end of a command buffer's life on the GPU: its buffers become accessible, its status final, and its
// completed handlers are queued.
void complete(CommandBuffer* cb, bool sync) {
  unguard_buffers(cb);
  set_status(cb, cb->failed ? MTL::CommandBufferStatusError : MTL::CommandBufferStatusCompleted);
  if (sync) {
    call_handlers(cb, cb->completed_handlers);
    return;
  }
  Completions& c = completions();
  std::lock_guard<std::mutex> lock(c.mu);
  if (!c.thread.joinable()) c.thread = std::thread(completion_main);
  c.busy++;
  c.ready.push_back(cb);
  c.cv.notify_all();
}

// Each command buffer starts when it is waited on, or FAKEMETAL_GPU_DELAY_MS (default 50) after its commit,
// whichever comes first. The delay makes the in-flight window deterministic: a CPU access between commit
// and wait finds the buffers still protected however fast the kernels run.
double gpu_delay() {
  static const double d = double(env_u64("FAKEMETAL_GPU_DELAY_MS", 50)) / 1000.0;
  return d;
}

void gpu_main(Queue* q) {
  for (;;) {
    CommandBuffer* cb;
    {
      std::unique_lock<std::mutex> lock(q->mu);
      for (;;) {
        if (q->stop) return;
        if (!q->order.empty() && q->order.front()->status.load() >= MTL::CommandBufferStatusCommitted) {
          CommandBuffer* head = q->order.front();
          const double start_at = head->commit_time + gpu_delay();
          if (head->seq <= q->kick || now_seconds() >= start_at) break;
          q->cv.wait_for(lock, std::chrono::duration<double>(start_at - now_seconds()));
          continue;
        }
        q->cv.wait(lock);
      }
      cb = q->order.front();
      q->order.pop_front();
      q->running = true;
    }
    execute(cb);
    complete(cb, false);
    std::lock_guard<std::mutex> lock(q->mu);
    q->running = false;
  }
}

std::mutex g_queues_mu;
std::vector<Queue*>& live_queues() {  // for drain_all
  static auto* v = new std::vector<Queue*>;
  return *v;
}

Queue::~Queue() {
  {
    std::lock_guard<std::mutex> lock(g_queues_mu);
    auto& v = live_queues();
    v.erase(std::remove(v.begin(), v.end(), this), v.end());
  }
  if (gpu.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    gpu.join();
  }
}

// Before the leak report at exit: committed work finishes (it holds references) and its handlers run.
void drain_all() {
  for (;;) {
    bool pending = false;
    {
      std::lock_guard<std::mutex> lock(g_queues_mu);
      for (Queue* q : live_queues()) {
        std::lock_guard<std::mutex> ql(q->mu);
        // Work behind an enqueued command buffer that was never committed can never run (as on Metal).
        if (q->running ||
            (!q->order.empty() && q->order.front()->status.load() >= MTL::CommandBufferStatusCommitted)) {
          pending = true;
          q->kick = q->next_seq;
          q->cv.notify_all();
        }
      }
    }
    Completions& c = completions();
    {
      std::unique_lock<std::mutex> lock(c.mu);
      if (!pending && c.busy == 0) return;
      if (!pending) {
        c.cv.wait(lock, [&] { return c.busy == 0; });
        continue;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Compiling MSL through the emulator
// ---------------------------------------------------------------------------------------------------------

std::string tools_dir() {
  const char* env = getenv("LILY_METALSIM_TOOLS");
  return env && *env ? env : FAKEMETAL_TOOLS_DIR;
}

// The emulator caches compiled libraries by source and file name, so the MSL goes to a content-addressed
// file under the metalsim cache (the same source compiles once across processes).
std::string source_file_for(const std::string& source) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : source) h = (h ^ c) * 1099511628211ull;
  const char* env = getenv("LILY_METALSIM_CACHE");
  const char* home = getenv("HOME");
  std::string root = env && *env ? env : std::string(home && *home ? home : "/tmp") + "/.cache/lily/metalsim";
  std::string dir = root + "/fakemetal-msl";
  for (size_t i = 1; i <= dir.size(); ++i)  // mkdir -p
    if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0755);
  char name[32];
  snprintf(name, sizeof name, "/msl-%016llx.metal", static_cast<unsigned long long>(h));
  const std::string path = dir + name;
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && size_t(st.st_size) == source.size()) return path;
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  std::ofstream(tmp, std::ios::binary) << source;
  if (rename(tmp.c_str(), path.c_str()) != 0) die("cannot write %s", path.c_str());
  return path;
}

// Runs the emulator's compiler on a .metal file; returns its exit status and its output (stdout + stderr).
int run_compiler(const std::string& src, std::string* output) {
  const char* py_env = getenv("FAKEMETAL_PYTHON");
  const std::string python = py_env && *py_env ? py_env : FAKEMETAL_PYTHON;
  const std::string tools = tools_dir();
  if (tools.empty()) die("the metalsim tools folder is unknown: set LILY_METALSIM_TOOLS");
  std::vector<std::string> args = {python, "-m", "metalsim", "compile", "--mode", FAKEMETAL_MODE, src};
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) {
    if (!strncmp(*e, "PYTHONPATH=", 11) || !strncmp(*e, "LD_PRELOAD=", 11)) continue;  // no sanitizer in python
    env_store.push_back(*e);
  }
  const char* old_pp = getenv("PYTHONPATH");
  env_store.push_back("PYTHONPATH=" + tools + (old_pp && *old_pp ? ":" + std::string(old_pp) : ""));
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : env_store) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) die("pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  pid_t pid;
  const int rc = posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    *output = "cannot run " + python + ": " + strerror(rc);
    return 127;
  }
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n > 0) output->append(buf, size_t(n));
    else if (n == 0 || errno != EINTR) break;
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// newLibraryWithSource: the emulator compiles the MSL (cached by content in the metalsim cache, where the
// shared object stays, so sanitizer reports can symbolize kernel lines even after this process exits).
objc_object* compile_library(Device* dev, const std::string& source, objc_object** error) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::string output;
  const int rc = run_compiler(source_file_for(source), &output);
  if (rc != 0) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure,
                                "Compilation failed: \n\n" + output));
    return nullptr;
  }
  // The compiler prints the library's path last.
  while (!output.empty() && (output.back() == '\n' || output.back() == ' ')) output.pop_back();
  const std::string path = output.substr(output.rfind('\n') == std::string::npos ? 0 : output.rfind('\n') + 1);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorInternal,
                                "fakemetal: cannot load the compiled library: " + std::string(dlerror()) +
                                    "\ncompiler output:\n" + output));
    return nullptr;
  }
  auto get = reinterpret_cast<const mslsim_library* (*)()>(dlsym(handle, "mslsim_library_get"));
  const mslsim_library* lib = get ? get() : nullptr;
  if (!lib || lib->abi_version != MSLSIM_ABI_VERSION) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorInternal,
                                "fakemetal: " + path + " has no mslsim_library_get or a different ABI version"));
    return nullptr;
  }
  Library* l = new_object<Library>(*C_library);
  l->set_device(dev);
  l->lib = lib;
  l->path = path;
  return l;
}

// ---------------------------------------------------------------------------------------------------------
// Method implementations (IMPs). Signatures follow metal-cpp's calls: (self, SEL, arguments...).
// ---------------------------------------------------------------------------------------------------------

using UInt = unsigned long;

// shared by every Metal object
objc_object* m_label(MtlObj* self, SEL) { return self->label; }
void m_set_label(MtlObj* self, SEL, objc_object* label) {
  objc_object* copy = label ? make_string(string_value(label)) : nullptr;
  release(self->label);
  self->label = copy;
}
objc_object* m_device(MtlObj* self, SEL) { return self->device; }

// MTLDevice
objc_object* dev_name(Device* self, SEL) { return self->name; }
objc_object* dev_new_queue(Device* self, SEL) {
  Queue* q = new_object<Queue>(*C_queue);
  q->set_device(self);
  std::lock_guard<std::mutex> lock(g_queues_mu);
  live_queues().push_back(q);
  return q;
}
objc_object* dev_new_queue_max(Device* self, SEL, UInt) { return dev_new_queue(self, nullptr); }
objc_object* dev_new_buffer(Device* self, SEL, UInt length, UInt options) {
  return new_buffer(self, nullptr, length, options);
}
objc_object* dev_new_buffer_bytes(Device* self, SEL, const void* bytes, UInt length, UInt options) {
  return new_buffer(self, bytes, length, options);
}
objc_object* dev_new_buffer_nocopy(Device* self, SEL, void* bytes, UInt length, UInt options, void* deallocator) {
  if (!bytes || length == 0) return nullptr;
  Buffer* b = new_object<Buffer>(*C_buffer);
  b->set_device(self);
  b->data = bytes;
  b->length = length;
  b->options = options;
  b->owns = false;
  b->deallocator = block_copy(deallocator);
  return b;
}
objc_object* dev_new_library(Device* self, SEL, objc_object* source, objc_object* options, objc_object** error) {
  if (error) *error = nullptr;
  if (!source) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure, "source is nil"));
    return nullptr;
  }
  // The emulator computes with exact (safe) math only. A library compiled for fast math would run other
  // numerics on the device than the emulator verifies, so it is refused unless FAKEMETAL_ALLOW_FAST_MATH=1.
  const unsigned long mode = options ? static_cast<CompileOptions*>(static_cast<Obj*>(options))->math_mode
                                     : (unsigned long)MTL::MathModeFast;
  if (mode != MTL::MathModeSafe && !env_flag("FAKEMETAL_ALLOW_FAST_MATH")) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure,
                                std::string("fakemetal: the library would be compiled with ") +
                                    (mode == MTL::MathModeRelaxed ? "relaxed" : "fast") +
                                    " math, but the emulator verifies safe math only: set "
                                    "MTLCompileOptions.mathMode = MTLMathModeSafe (fastMathEnabled = NO)"));
    return nullptr;
  }
  objc_object* lib = compile_library(self, string_value(source), error);
  if (lib) as<Library>(lib)->math_mode = mode;
  return lib;
}
objc_object* dev_new_pipeline(Device* self, SEL, Function* fn, objc_object** error) {
  if (error) *error = nullptr;
  if (!fn) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorInternal, "function is nil"));
    return nullptr;
  }
  if (fn->info != C_function)
    die("newComputePipelineStateWithFunction: given a %s, not an MTLFunction", fn->info->name.c_str());
  const size_t static_tg = fn->kernel->static_threadgroup_bytes ? fn->kernel->static_threadgroup_bytes() : 0;
  if (static_tg > limits().max_tg_memory) {  // Metal refuses such a pipeline
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure,
                                "fakemetal: kernel '" + std::string(fn->kernel->name) + "' declares " +
                                    std::to_string(static_tg) + " bytes of threadgroup memory; the device allows " +
                                    std::to_string(limits().max_tg_memory)));
    return nullptr;
  }
  Pipeline* p = new_object<Pipeline>(*C_pipeline);
  p->set_device(self);
  retain(fn);
  p->function = fn;
  p->static_tg = static_tg;
  return p;
}
MTL::Size dev_max_threads(Device*, SEL) {
  const unsigned long n = limits().max_threads;
  return MTL::Size(n, n, n);
}
UInt dev_max_tg_memory(Device*, SEL) { return limits().max_tg_memory; }
UInt dev_max_buffer(Device*, SEL) { return limits().max_buffer; }
uint64_t dev_working_set(Device*, SEL) { return limits().working_set; }
UInt dev_allocated(Device*, SEL) { return g_allocated.load(); }
bool dev_true(Device*, SEL) { return true; }
bool dev_false(Device*, SEL) { return false; }
uint64_t dev_registry(Device*, SEL) { return 0x1117; }
bool dev_supports_family(Device*, SEL, long family) {
  // Apple7..9 (M1..M3+) and the Common / Metal3 families: what Lily's kernels target.
  return (family >= MTL::GPUFamilyApple1 && family <= MTL::GPUFamilyApple9) ||
         (family >= MTL::GPUFamilyCommon1 && family <= MTL::GPUFamilyCommon3) || family == MTL::GPUFamilyMetal3;
}

// MTLCommandQueue
objc_object* q_command_buffer(Queue* self, SEL) {
  CommandBuffer* cb = new_object<CommandBuffer>(*C_command_buffer);
  cb->set_device(self->device);
  retain(self);
  cb->queue = self;
  return autorelease(cb);
}
objc_object* q_command_buffer_unretained(Queue* self, SEL) {
  objc_object* cb = q_command_buffer(self, nullptr);
  as<CommandBuffer>(cb)->retain_refs = false;
  return cb;
}

// MTLCommandBuffer
void cb_check_new_encoder(CommandBuffer* self, const char* what) {
  if (self->status != MTL::CommandBufferStatusNotEnqueued && self->status != MTL::CommandBufferStatusEnqueued)
    die("-[MTLCommandBuffer %s] after commit", what);
  if (self->open) die("-[MTLCommandBuffer %s] while another encoder is open (call endEncoding first)", what);
}
objc_object* new_encoder(CommandBuffer* self, ClassInfo* cls, bool compute, bool concurrent) {
  auto rec = std::make_shared<Recording>();
  rec->owner = self;
  rec->compute = compute;
  rec->concurrent = concurrent;
  rec->retain_refs = self->retain_refs;
  self->encoders.push_back(rec);
  self->open = rec.get();
  Encoder* e = new_object<Encoder>(*cls);
  e->set_device(self->device);
  e->rec = std::move(rec);
  return autorelease(e);  // the caller's pool holds the only reference
}
objc_object* cb_compute_encoder_type(CommandBuffer* self, SEL, UInt type) {
  cb_check_new_encoder(self, "computeCommandEncoder");
  return new_encoder(self, C_compute_encoder, true, type == MTL::DispatchTypeConcurrent);
}
objc_object* cb_compute_encoder(CommandBuffer* self, SEL) {
  return cb_compute_encoder_type(self, nullptr, MTL::DispatchTypeSerial);
}
objc_object* cb_blit_encoder(CommandBuffer* self, SEL) {
  cb_check_new_encoder(self, "blitCommandEncoder");
  return new_encoder(self, C_blit_encoder, false, false);
}
bool sync_mode() {
  static const bool sync = env_flag("FAKEMETAL_SYNC");
  return sync;
}
// enqueue reserves the command buffer's place in its queue's order (commit does it when enqueue was not called).
void cb_enqueue(CommandBuffer* self, SEL) {
  if (self->status != MTL::CommandBufferStatusNotEnqueued) return;
  Queue* q = as<Queue>(self->queue);
  std::lock_guard<std::mutex> lock(q->mu);
  self->seq = ++q->next_seq;
  if (!sync_mode()) q->order.push_back(self);
  set_status(self, MTL::CommandBufferStatusEnqueued);
}
void cb_commit(CommandBuffer* self, SEL) {
  if (self->status >= MTL::CommandBufferStatusCommitted) die("-[MTLCommandBuffer commit] called twice");
  if (self->open) die("-[MTLCommandBuffer commit] with an open %s (call endEncoding first)", self->open->kind());
  cb_enqueue(self, nullptr);
  retain(self);  // a committed command buffer stays alive until it completes (and its handlers have run)
  if (sync_mode()) {
    set_status(self, MTL::CommandBufferStatusCommitted);
    execute(self);
    complete(self, true);
    release(self);
    return;
  }
  guard_buffers(self);
  Queue* q = as<Queue>(self->queue);
  std::lock_guard<std::mutex> lock(q->mu);
  self->commit_time = now_seconds();
  set_status(self, MTL::CommandBufferStatusCommitted);
  if (!q->gpu.joinable()) q->gpu = std::thread(gpu_main, q);
  q->cv.notify_all();
}
void wait_for(CommandBuffer* self, unsigned long status, const char* what) {
  if (self->status < MTL::CommandBufferStatusCommitted)
    die("-[MTLCommandBuffer %s] on a command buffer that was never committed (waits forever)", what);
  Queue* q = as<Queue>(self->queue);
  {
    std::lock_guard<std::mutex> lock(q->mu);
    q->kick = std::max(q->kick, self->seq);  // this one and everything enqueued before it start now
    q->cv.notify_all();
  }
  std::unique_lock<std::mutex> lock(self->mu);
  self->cv.wait(lock, [&] { return self->status.load() >= status; });
}
void cb_wait(CommandBuffer* self, SEL) {
  wait_for(self, MTL::CommandBufferStatusCompleted, "waitUntilCompleted");
}
void cb_wait_scheduled(CommandBuffer* self, SEL) {
  wait_for(self, MTL::CommandBufferStatusScheduled, "waitUntilScheduled");
}
UInt cb_status(CommandBuffer* self, SEL) { return self->status; }
objc_object* cb_error(CommandBuffer* self, SEL) { return self->error; }
objc_object* cb_queue(CommandBuffer* self, SEL) { return self->queue; }
void cb_add_completed(CommandBuffer* self, SEL, void* block) {
  if (self->status >= MTL::CommandBufferStatusCommitted) die("-[MTLCommandBuffer addCompletedHandler:] after commit");
  self->completed_handlers.push_back(block_copy(block));
}
void cb_add_scheduled(CommandBuffer* self, SEL, void* block) {
  if (self->status >= MTL::CommandBufferStatusCommitted) die("-[MTLCommandBuffer addScheduledHandler:] after commit");
  self->scheduled_handlers.push_back(block_copy(block));
}
double cb_start(CommandBuffer* self, SEL) { return self->start_time; }
double cb_end(CommandBuffer* self, SEL) { return self->end_time; }

// Encoders (compute and blit)
void enc_end(Encoder* self, SEL) {
  Recording* r = self->rec.get();
  r->check_open("endEncoding");
  r->ended = true;
  if (r->owner && r->owner->open == r) r->owner->open = nullptr;
}
void enc_noop_str(Encoder* self, SEL, objc_object*) { self->rec->check_open("debug group"); }
void enc_noop(Encoder* self, SEL) { self->rec->check_open("debug group"); }
void enc_use_resource(Encoder* self, SEL, objc_object*, UInt) { self->rec->check_open("useResource:usage:"); }

void check_index(const Encoder* self, const char* what, UInt index) {
  self->rec->check_open(what);
  if (index >= UInt(kMaxBindings))
    die("-[MTLComputeCommandEncoder %s]: index %lu is out of range (max %d)", what, index, kMaxBindings - 1);
}
void ce_set_pipeline(Encoder* self, SEL, Pipeline* p) {
  self->rec->check_open("setComputePipelineState:");
  if (p && p->info != C_pipeline) die("setComputePipelineState: given a %s", p->info->name.c_str());
  self->rec->pipeline = p;
}
void ce_set_buffer(Encoder* self, SEL, Buffer* b, UInt offset, UInt index) {
  check_index(self, "setBuffer:offset:atIndex:", index);
  if (b && b->info != C_buffer) die("setBuffer:offset:atIndex: given a %s, not an MTLBuffer", b->info->name.c_str());
  Binding& slot = self->rec->bind[index];
  slot = Binding{};
  slot.buffer = b;
  slot.offset = offset;
  slot.set = b != nullptr;
}
void ce_set_buffer_offset(Encoder* self, SEL, UInt offset, UInt index) {
  check_index(self, "setBufferOffset:atIndex:", index);
  if (!self->rec->bind[index].buffer) die("setBufferOffset:atIndex: index %lu has no buffer bound", index);
  self->rec->bind[index].offset = offset;
}
void ce_set_buffers(Encoder* self, SEL, Buffer* const* buffers, const UInt* offsets, NS::Range range) {
  for (UInt i = 0; i < range.length; ++i)
    ce_set_buffer(self, nullptr, buffers[i], offsets[i], range.location + i);
}
void ce_set_bytes(Encoder* self, SEL, const void* bytes, UInt length, UInt index) {
  check_index(self, "setBytes:length:atIndex:", index);
  if (length > kMaxSetBytes)
    die("setBytes:length:atIndex: %lu bytes at index %lu: Metal allows at most %lu (use a buffer)", length, index,
        kMaxSetBytes);
  Binding& slot = self->rec->bind[index];
  slot = Binding{};
  slot.bytes = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(bytes),
                                                       static_cast<const uint8_t*>(bytes) + length);
  slot.set = true;
}
void ce_set_tg_memory(Encoder* self, SEL, UInt length, UInt index) {
  check_index(self, "setThreadgroupMemoryLength:atIndex:", index);
  if (length % 16 != 0)
    die("setThreadgroupMemoryLength:atIndex: length %lu at index %lu is not a multiple of 16", length, index);
  self->rec->threadgroup_bytes[index] = length;
}
void record(Encoder* self, Command c) {
  c.ordinal = self->rec->commands++;
  c.pipeline = self->rec->pipeline;
  c.bind = self->rec->bind;
  c.threadgroup_bytes = self->rec->threadgroup_bytes;
  self->rec->hold(c);
  // A serial encoder: every dispatch is its own stage.
  if (!self->rec->concurrent && !self->rec->stages.back().empty()) self->rec->stages.emplace_back();
  self->rec->stages.back().push_back(std::move(c));
}
void set_size(uint32_t* out, const MTL::Size& s) {
  out[0] = uint32_t(s.width), out[1] = uint32_t(s.height), out[2] = uint32_t(s.depth);
}
void ce_dispatch_groups(Encoder* self, SEL, MTL::Size groups, MTL::Size threads) {
  self->rec->check_open("dispatchThreadgroups:threadsPerThreadgroup:");
  Command c;
  set_size(c.groups, groups);
  set_size(c.threads, threads);
  record(self, std::move(c));
}
void ce_dispatch_threads(Encoder* self, SEL, MTL::Size grid, MTL::Size threads) {
  self->rec->check_open("dispatchThreads:threadsPerThreadgroup:");
  Command c;
  c.by_threads = true;
  set_size(c.grid, grid);
  set_size(c.threads, threads);
  record(self, std::move(c));
}
// A scope barrier orders buffers only when its scope includes MTLBarrierScopeBuffers (a textures-only or
// render-targets-only barrier leaves buffer accesses unordered); it then ends the stage.
void ce_barrier_scope(Encoder* self, SEL, UInt scope) {
  self->rec->check_open("memoryBarrierWithScope:");
  if ((scope & MTL::BarrierScopeBuffers) && !self->rec->stages.back().empty()) self->rec->stages.emplace_back();
}
// A resource barrier orders only the listed resources: it stays inside the stage as a marker.
void ce_barrier_resources(Encoder* self, SEL, objc_object* const* resources, UInt count) {
  self->rec->check_open("memoryBarrierWithResources:count:");
  if (!self->rec->concurrent || self->rec->stages.back().empty()) return;  // nothing before it to order
  Command c;
  c.kind = Command::Barrier;
  c.ordinal = -1;
  for (UInt i = 0; i < count; ++i) c.resources.push_back(resources[i]);
  self->rec->stages.back().push_back(std::move(c));
}
UInt ce_dispatch_type(Encoder* self, SEL) {
  return self->rec->concurrent ? MTL::DispatchTypeConcurrent : MTL::DispatchTypeSerial;
}

// MTLBlitCommandEncoder: every command is its own stage (blits are ordered)
void be_copy(Encoder* self, SEL, Buffer* src, UInt src_offset, Buffer* dst, UInt dst_offset, UInt size) {
  self->rec->check_open("copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:");
  Command c;
  c.kind = Command::Copy;
  c.ordinal = self->rec->commands++;
  c.src = src, c.dst = dst, c.src_offset = src_offset, c.dst_offset = dst_offset, c.size = size;
  self->rec->hold(c);
  if (!self->rec->stages.back().empty()) self->rec->stages.emplace_back();
  self->rec->stages.back().push_back(std::move(c));
}
void be_fill(Encoder* self, SEL, Buffer* dst, NS::Range range, uint8_t value) {
  self->rec->check_open("fillBuffer:range:value:");
  Command c;
  c.kind = Command::Fill;
  c.ordinal = self->rec->commands++;
  c.dst = dst, c.dst_offset = range.location, c.size = range.length, c.value = value;
  self->rec->hold(c);
  if (!self->rec->stages.back().empty()) self->rec->stages.emplace_back();
  self->rec->stages.back().push_back(std::move(c));
}

// MTLBuffer
void* buf_contents(Buffer* self, SEL) { return self->is_private() ? nullptr : self->data; }
UInt buf_length(Buffer* self, SEL) { return self->length; }
void buf_did_modify(Buffer*, SEL, NS::Range) {}
uint64_t buf_gpu_address(Buffer* self, SEL) { return reinterpret_cast<uint64_t>(self->data); }
UInt buf_storage_mode(Buffer* self, SEL) { return (self->options >> 4) & 0xf; }
UInt buf_options(Buffer* self, SEL) { return self->options; }

// MTLLibrary
const mslsim_kernel* find_kernel(const Library* l, const std::string& name) {
  for (int i = 0; i < l->lib->n_kernels; ++i)
    if (name == l->lib->kernels[i].name) return &l->lib->kernels[i];
  return nullptr;
}
Function* make_function(Library* self, const mslsim_kernel* k) {
  Function* f = new_object<Function>(*C_function);
  f->set_device(self->device);
  retain(self);
  f->library = self;
  f->kernel = k;
  f->name = make_string(k->name);
  return f;
}
objc_object* lib_new_function(Library* self, SEL, objc_object* name) {
  const mslsim_kernel* k = find_kernel(self, string_value(name));
  return k ? make_function(self, k) : nullptr;  // Metal: nil, no error
}
objc_object* lib_new_function_constants(Library* self, SEL, objc_object* name, ConstantValues* values,
                                        objc_object** error) {
  if (error) *error = nullptr;
  const std::string n = string_value(name);
  const mslsim_kernel* k = find_kernel(self, n);
  if (!k) {
    set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorFunctionNotFound,
                                "Function " + n + " was not found in the library"));
    return nullptr;
  }
  std::vector<std::pair<int, std::vector<uint8_t>>> constants;
  auto add = [&](const mslsim_function_constant& fc, const ConstantValue& v) -> bool {
    size_t size;
    const char* msl;
    if (!data_type_info(v.type, &size, &msl)) {
      set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorUnsupported,
                                  "function constant " + std::string(fc.name) + ": unsupported MTLDataType " +
                                      std::to_string(v.type)));
      return false;
    }
    if (normalize_msl_type(fc.type) != msl || size != fc.size) {
      set_error(error, make_error("MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure,
                                  "function constant '" + std::string(fc.name) + "' (index " +
                                      std::to_string(fc.index) + ") has type " + fc.type +
                                      " but was given a value of type " + msl));
      return false;
    }
    for (auto& c : constants)
      if (c.first == fc.index) {
        c.second = v.bytes;
        return true;
      }
    constants.emplace_back(fc.index, v.bytes);
    return true;
  };
  if (values) {
    for (const auto& [index, v] : values->by_index)
      for (int i = 0; i < self->lib->n_constants; ++i)
        if (UInt(self->lib->constants[i].index) == index && !add(self->lib->constants[i], v)) return nullptr;
    for (const auto& [cname, v] : values->by_name)
      for (int i = 0; i < self->lib->n_constants; ++i)
        if (cname == self->lib->constants[i].name && !add(self->lib->constants[i], v)) return nullptr;
  }
  Function* f = make_function(self, k);
  f->constants = std::move(constants);
  return f;
}
objc_object* lib_function_names(Library* self, SEL) {
  std::vector<objc_object*> names;
  for (int i = 0; i < self->lib->n_kernels; ++i) names.push_back(make_string(self->lib->kernels[i].name));
  objc_object* arr = make_array(names);
  for (objc_object* s : names) release(s);
  return autorelease(arr);
}

// MTLFunctionConstantValues
void fcv_set(ConstantValues* self, SEL, const void* value, UInt type, UInt index) {
  size_t size;
  const char* msl;
  if (!data_type_info(type, &size, &msl)) die("setConstantValue:type:atIndex: unsupported MTLDataType %lu", type);
  const auto* bytes = static_cast<const uint8_t*>(value);
  ConstantValue v{type, std::vector<uint8_t>(bytes, bytes + size)};
  for (auto& e : self->by_index)
    if (e.first == index) {
      e.second = std::move(v);
      return;
    }
  self->by_index.emplace_back(index, std::move(v));
}
void fcv_set_named(ConstantValues* self, SEL, const void* value, UInt type, objc_object* name) {
  size_t size;
  const char* msl;
  if (!data_type_info(type, &size, &msl)) die("setConstantValue:type:withName: unsupported MTLDataType %lu", type);
  self->by_name.emplace_back(string_value(name), ConstantValue{type, std::vector<uint8_t>(
      static_cast<const uint8_t*>(value), static_cast<const uint8_t*>(value) + size)});
}
void fcv_set_range(ConstantValues* self, SEL, const void* values, UInt type, NS::Range range) {
  size_t size;
  const char* msl;
  if (!data_type_info(type, &size, &msl)) die("setConstantValues:type:withRange: unsupported MTLDataType %lu", type);
  for (UInt i = 0; i < range.length; ++i)
    fcv_set(self, nullptr, static_cast<const uint8_t*>(values) + i * size, type, range.location + i);
}
void fcv_reset(ConstantValues* self, SEL) {
  self->by_index.clear();
  self->by_name.clear();
}

// MTLFunction / MTLComputePipelineState
objc_object* fn_name(Function* self, SEL) { return self->name; }
UInt fn_type(Function*, SEL) { return MTL::FunctionTypeKernel; }
UInt ps_max_threads(Pipeline*, SEL) { return limits().max_threads; }
UInt ps_width(Pipeline*, SEL) { return kThreadExecutionWidth; }
UInt ps_static_tg(Pipeline* self, SEL) { return self->static_tg; }

// MTLCompileOptions
void co_set_version(CompileOptions* self, SEL, UInt v) { self->language_version = v; }
UInt co_version(CompileOptions* self, SEL) { return self->language_version; }
// fastMathEnabled is the older switch over the same setting as mathMode: the later call wins.
void co_set_fast_math(CompileOptions* self, SEL, bool v) { self->math_mode = v ? MTL::MathModeFast : MTL::MathModeSafe; }
bool co_fast_math(CompileOptions* self, SEL) { return self->math_mode == MTL::MathModeFast; }
void co_set_math_mode(CompileOptions* self, SEL, UInt v) { self->math_mode = v; }
UInt co_math_mode(CompileOptions* self, SEL) { return self->math_mode; }
void co_ignore_uint(CompileOptions*, SEL, UInt) {}
void co_ignore_obj(CompileOptions*, SEL, objc_object*) {}

}  // namespace

void register_metal_classes() {
  g_before_exit_report = &drain_all;
  ClassInfo& base = define_class("_FakeMTLObject", "NSObject");
  def(base, "label", &m_label);
  def(base, "setLabel:", &m_set_label);
  def(base, "device", &m_device);

  ClassInfo& dev = define_class("MTLDevice", "_FakeMTLObject");
  C_device = &dev;
  def(dev, "name", &dev_name);
  def(dev, "newCommandQueue", &dev_new_queue);
  def(dev, "newCommandQueueWithMaxCommandBufferCount:", &dev_new_queue_max);
  def(dev, "newBufferWithLength:options:", &dev_new_buffer);
  def(dev, "newBufferWithBytes:length:options:", &dev_new_buffer_bytes);
  def(dev, "newBufferWithBytesNoCopy:length:options:deallocator:", &dev_new_buffer_nocopy);
  def(dev, "newLibraryWithSource:options:error:", &dev_new_library);
  def(dev, "newComputePipelineStateWithFunction:error:", &dev_new_pipeline);
  def(dev, "maxThreadsPerThreadgroup", &dev_max_threads);
  def(dev, "maxThreadgroupMemoryLength", &dev_max_tg_memory);
  def(dev, "maxBufferLength", &dev_max_buffer);
  def(dev, "recommendedMaxWorkingSetSize", &dev_working_set);
  def(dev, "currentAllocatedSize", &dev_allocated);
  def(dev, "hasUnifiedMemory", &dev_true);
  def(dev, "isLowPower", &dev_false);
  def(dev, "isHeadless", &dev_true);
  def(dev, "isRemovable", &dev_false);
  def(dev, "registryID", &dev_registry);
  def(dev, "supportsFamily:", &dev_supports_family);

  ClassInfo& q = define_class("MTLCommandQueue", "_FakeMTLObject");
  C_queue = &q;
  def(q, "commandBuffer", &q_command_buffer);
  def(q, "commandBufferWithUnretainedReferences", &q_command_buffer_unretained);

  ClassInfo& cb = define_class("MTLCommandBuffer", "_FakeMTLObject");
  C_command_buffer = &cb;
  def(cb, "computeCommandEncoder", &cb_compute_encoder);
  def(cb, "computeCommandEncoderWithDispatchType:", &cb_compute_encoder_type);
  def(cb, "blitCommandEncoder", &cb_blit_encoder);
  def(cb, "enqueue", &cb_enqueue);
  def(cb, "commit", &cb_commit);
  def(cb, "waitUntilCompleted", &cb_wait);
  def(cb, "waitUntilScheduled", &cb_wait_scheduled);
  def(cb, "status", &cb_status);
  def(cb, "error", &cb_error);
  def(cb, "commandQueue", &cb_queue);
  def(cb, "addCompletedHandler:", &cb_add_completed);
  def(cb, "addScheduledHandler:", &cb_add_scheduled);
  def(cb, "GPUStartTime", &cb_start);
  def(cb, "GPUEndTime", &cb_end);
  def(cb, "kernelStartTime", &cb_start);
  def(cb, "kernelEndTime", &cb_end);

  ClassInfo& enc = define_class("_FakeMTLCommandEncoder", "_FakeMTLObject");
  def(enc, "endEncoding", &enc_end);
  def(enc, "pushDebugGroup:", &enc_noop_str);
  def(enc, "insertDebugSignpost:", &enc_noop_str);
  def(enc, "popDebugGroup", &enc_noop);

  ClassInfo& ce = define_class("MTLComputeCommandEncoder", "_FakeMTLCommandEncoder");
  C_compute_encoder = &ce;
  def(ce, "setComputePipelineState:", &ce_set_pipeline);
  def(ce, "setBuffer:offset:atIndex:", &ce_set_buffer);
  def(ce, "setBufferOffset:atIndex:", &ce_set_buffer_offset);
  def(ce, "setBuffers:offsets:withRange:", &ce_set_buffers);
  def(ce, "setBytes:length:atIndex:", &ce_set_bytes);
  def(ce, "setThreadgroupMemoryLength:atIndex:", &ce_set_tg_memory);
  def(ce, "dispatchThreadgroups:threadsPerThreadgroup:", &ce_dispatch_groups);
  def(ce, "dispatchThreads:threadsPerThreadgroup:", &ce_dispatch_threads);
  def(ce, "memoryBarrierWithScope:", &ce_barrier_scope);
  def(ce, "memoryBarrierWithResources:count:", &ce_barrier_resources);
  def(ce, "dispatchType", &ce_dispatch_type);
  def(ce, "useResource:usage:", &enc_use_resource);

  ClassInfo& be = define_class("MTLBlitCommandEncoder", "_FakeMTLCommandEncoder");
  C_blit_encoder = &be;
  def(be, "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:", &be_copy);
  def(be, "fillBuffer:range:value:", &be_fill);

  ClassInfo& buf = define_class("MTLBuffer", "_FakeMTLObject");
  C_buffer = &buf;
  def(buf, "contents", &buf_contents);
  def(buf, "length", &buf_length);
  def(buf, "allocatedSize", &buf_length);
  def(buf, "didModifyRange:", &buf_did_modify);
  def(buf, "gpuAddress", &buf_gpu_address);
  def(buf, "storageMode", &buf_storage_mode);
  def(buf, "resourceOptions", &buf_options);

  ClassInfo& lib = define_class("MTLLibrary", "_FakeMTLObject");
  C_library = &lib;
  def(lib, "newFunctionWithName:", &lib_new_function);
  def(lib, "newFunctionWithName:constantValues:error:", &lib_new_function_constants);
  def(lib, "functionNames", &lib_function_names);

  ClassInfo& fn = define_class("MTLFunction", "_FakeMTLObject");
  C_function = &fn;
  def(fn, "name", &fn_name);
  def(fn, "functionType", &fn_type);

  ClassInfo& fcv = define_class("MTLFunctionConstantValues", "_FakeMTLObject");
  C_constant_values = &fcv;
  fcv.make = +[]() -> objc_object* { return new_object<ConstantValues>(*C_constant_values); };
  def(fcv, "setConstantValue:type:atIndex:", &fcv_set);
  def(fcv, "setConstantValue:type:withName:", &fcv_set_named);
  def(fcv, "setConstantValues:type:withRange:", &fcv_set_range);
  def(fcv, "reset", &fcv_reset);

  ClassInfo& ps = define_class("MTLComputePipelineState", "_FakeMTLObject");
  C_pipeline = &ps;
  def(ps, "maxTotalThreadsPerThreadgroup", &ps_max_threads);
  def(ps, "threadExecutionWidth", &ps_width);
  def(ps, "staticThreadgroupMemoryLength", &ps_static_tg);

  ClassInfo& co = define_class("MTLCompileOptions", "_FakeMTLObject");
  C_compile_options = &co;
  co.make = +[]() -> objc_object* { return new_object<CompileOptions>(*C_compile_options); };
  def(co, "setLanguageVersion:", &co_set_version);
  def(co, "languageVersion", &co_version);
  def(co, "setFastMathEnabled:", &co_set_fast_math);
  def(co, "fastMathEnabled", &co_fast_math);
  def(co, "setMathMode:", &co_set_math_mode);
  def(co, "mathMode", &co_math_mode);
  def(co, "setMathFloatingPointFunctions:", &co_ignore_uint);
  def(co, "setOptimizationLevel:", &co_ignore_uint);
  def(co, "setPreserveInvariance:", &co_ignore_uint);
  def(co, "setLibraryType:", &co_ignore_uint);
  def(co, "setInstallName:", &co_ignore_obj);

  ClassInfo& obs = define_class("MTLDeviceObserver", "NSObject");
  C_observer = &obs;
  obs.make = +[]() -> objc_object* { return new_object<Obj>(*C_observer); };
}

}  // namespace fakemetal

using namespace fakemetal;

extern "C" {

__attribute__((visibility("default"))) MTL::Device* MTLCreateSystemDefaultDevice() {
  find_class("MTLDevice");  // registers the classes
  return reinterpret_cast<MTL::Device*>(default_device());
}

__attribute__((visibility("default"))) NS::Array* MTLCopyAllDevices() {
  find_class("MTLDevice");
  objc_object* d = default_device();
  objc_object* a = make_array({d});
  release(d);
  return reinterpret_cast<NS::Array*>(a);
}

__attribute__((visibility("default"))) NS::Array* MTLCopyAllDevicesWithObserver(NS::Object** observer,
                                                                                MTL::DeviceNotificationHandlerBlock) {
  NS::Array* a = MTLCopyAllDevices();
  if (observer) *observer = reinterpret_cast<NS::Object*>(C_observer->make());  // no device is ever added or removed
  return a;
}

__attribute__((visibility("default"))) void MTLRemoveDeviceObserver(const NS::Object* observer) {
  release(reinterpret_cast<objc_object*>(const_cast<NS::Object*>(observer)));
}

}  // extern "C"
