// libmslsim: runs one MSL kernel dispatch on the CPU with real threadgroup / simdgroup semantics.
// Threadgroups are spread over a persistent pool of worker threads; inside a worker every lane of the
// threadgroup is a stackful fiber, run cooperatively until it reaches a synchronisation point
// (threadgroup_barrier or a simd_* collective) or returns. Mismatched synchronisation (divergent simd_*
// calls, a lane that returns while others wait at a barrier) fails the dispatch with a message naming
// the kernel and the source sites.
#include "mslsim/abi.h"
#include "mslsim/lane.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// The asan build defines MSLSIM_ASAN=1: libmslsim itself is not instrumented (its frames, left behind on
// fiber stacks that never return, would leave stale poison for the next lane), but it tells ASan about
// every stack switch and clears poison left on stacks of abandoned lanes.
#ifndef MSLSIM_ASAN
#define MSLSIM_ASAN 0
#endif
#if MSLSIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" void mslsim_swap_context(void** save_sp, void* new_sp);
extern "C" void mslsim_fiber_entry(void);

namespace {

// ASan's redzones make frames much larger, so its lanes get bigger stacks. Pages are only touched as
// used, so the reservation costs address space, not memory.
constexpr size_t kStackSize = MSLSIM_ASAN ? (512u << 10) : (64u << 10);
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;     // Apple GPUs; LILY_METALSIM_MAX_THREADS_PER_THREADGROUP
constexpr size_t kMaxThreadgroupMemory = 32768;          // Apple GPUs; LILY_METALSIM_MAX_THREADGROUP_MEMORY

// A device limit: the dispatch's value, else the environment's (so the job runner and the fake Metal
// runtime agree on one configured device), else the default.
uint64_t limit(uint64_t given, const char* env, uint64_t dflt) {
  if (given) return given;
  const char* v = getenv(env);
  if (v && *v) {
    char* end = nullptr;
    unsigned long long x = strtoull(v, &end, 0);
    if (end && *end == 0 && x) return x;
  }
  return dflt;
}

size_t round16(size_t n) { return (n + 15) & ~size_t(15); }

struct Stack {
  char* base = nullptr;  // lowest usable byte (the guard page lies just below)
  size_t size = 0;
  bool dirty = false;    // abandoned mid-run: ASan's stack poisoning must be cleared before reuse
};

Stack new_stack() {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  void* p = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "mslsim: cannot map a fiber stack\n");
    abort();
  }
  mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting a neighbour
  Stack s;
  s.base = (char*)p + page;
  s.size = kStackSize;
  return s;
}

struct Site {
  const char* what = "";
  const char* file = "";
  unsigned line = 0, column = 0;
};

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.column == b.column && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

std::string describe(const Site& s) {
  char buf[64];
  snprintf(buf, sizeof buf, ":%u", s.line);
  return std::string(s.what) + " at " + s.file + buf;
}

enum LaneState { RUNNABLE, WAIT_SIMD, WAIT_BARRIER, EXITED };

struct Lane {
  void* sp = nullptr;
  Stack* stack = nullptr;
  void* asan_fake = nullptr;
  mslsim_builtins b;
  int state = RUNNABLE;
  int index = 0;  // thread_index_in_threadgroup
  int simd = 0;   // simdgroup_index_in_threadgroup
  void* coll_data = nullptr;
  Site site;
};

struct SimdGroup {
  int first = 0, count = 0;  // lanes [first, first + count) of the threadgroup
  int active = 0;            // lanes that have not returned
  int waiting = 0;           // lanes waiting at the pending collective
  Site site;
  mslsim_collective_fn fn = nullptr;
  int flags = 0;
};

struct Job {
  const mslsim_dispatch* d = nullptr;
  const mslsim_kernel* k = nullptr;
  uint32_t ntg[3] = {1, 1, 1};
  uint32_t tptg[3] = {1, 1, 1};
  uint32_t grid[3] = {0, 0, 0};  // threads_per_grid
  bool partial = false;          // dispatchThreads: edge threadgroups are clipped to the grid
  uint32_t width = 32;
  uint64_t total = 0;
  std::vector<uint64_t> order;  // threadgroup start order when shuffled (threadgroup_order_seed)
  size_t dynamic_tg = 0;        // bytes of [[threadgroup(i)]] memory the kernel's arguments use
  size_t max_tg = 0;            // the device's threadgroup memory limit
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string err;
};

struct TgBlock {
  const void* key;
  void* mem;
  size_t size;
  uint64_t stamp;
};

// Device-memory traffic of one dispatch on one worker (mslsim_dispatch::traffic): which bytes of the bound
// buffers its lanes read and wrote (a bit per byte and kind, in 4 KiB pages), and the bytes of all accesses.
struct TrafficPage {
  uint64_t bits[2][64];  // [write][4096 bits]
};
struct Traffic {
  const mslsim_dispatch* d = nullptr;  // null: not recording
  std::unordered_map<uintptr_t, TrafficPage*> pages;
  uintptr_t last_index = ~uintptr_t(0);
  TrafficPage* last = nullptr;
  uint64_t accessed[2] = {0, 0};

  void clear() {
    for (auto& [i, pg] : pages) delete pg;
    pages.clear();
    last_index = ~uintptr_t(0);
    last = nullptr;
    accessed[0] = accessed[1] = 0;
  }
  TrafficPage* page(uintptr_t index) {
    if (index == last_index) return last;
    TrafficPage*& pg = pages[index];
    if (!pg) pg = new TrafficPage();  // zeroed
    last_index = index;
    return last = pg;
  }
  void record(uintptr_t a, size_t size, int write) {
    bool inside = false;
    for (int i = 0; i < MSLSIM_MAX_BINDINGS && !inside; ++i) {
      const uintptr_t lo = uintptr_t(d->buffers[i]);
      inside = lo && a >= lo && a < lo + d->buffer_bytes[i];
    }
    if (!inside) return;  // thread-private or threadgroup memory, or the argument table itself
    accessed[write] += size;
    for (uintptr_t b = a; b < a + size; ++b) {
      TrafficPage* pg = page(b >> 12);
      const uintptr_t bit = b & 4095;
      pg->bits[write][bit >> 6] |= uint64_t(1) << (bit & 63);
    }
  }
};

struct Worker {
  std::thread thread;
  std::vector<Stack> stacks;
  std::vector<Lane> lanes;
  std::vector<SimdGroup> sgs;
  std::vector<int> queue;
  size_t qhead = 0, qtail = 0;
  void* sched_sp = nullptr;
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;

  Job* job = nullptr;
  int nlanes = 0, exited = 0, barrier_waiting = 0;
  Site barrier_site;
  bool tg_failed = false;
  std::string tg_err;
  uint64_t serial = 0;  // unique per threadgroup run: stamps threadgroup storage for re-poisoning
  size_t tg_static_used = 0;  // bytes of threadgroup declarations this threadgroup has reached
  uint64_t rng = 0;     // 0: in-order scheduling
  uint32_t tgpos[3] = {0, 0, 0};

  std::vector<void*> args;
  void* tg_param_mem[MSLSIM_MAX_BINDINGS] = {};
  size_t tg_param_size[MSLSIM_MAX_BINDINGS] = {};
  std::vector<TgBlock> blocks;
  size_t last_block = 0;
  Traffic traffic;
};

thread_local Worker* t_worker = nullptr;
thread_local Traffic* t_traffic = nullptr;  // this worker's record while a dispatch with traffic runs
thread_local Lane* t_lane = nullptr;
std::atomic<uint64_t> g_serial{1};

uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void push(Worker* w, int lane) {
  w->queue[w->qtail] = lane;
  w->qtail = (w->qtail + 1) % w->queue.size();
}

// Makes the given lanes runnable; in shuffled mode in a fresh random order each time.
void release(Worker* w, int* ids, int n) {
  if (w->rng) {
    for (int i = n - 1; i > 0; --i) {
      int j = (int)(splitmix(w->rng) % (uint64_t)(i + 1));
      int t = ids[i];
      ids[i] = ids[j];
      ids[j] = t;
    }
  }
  for (int i = 0; i < n; ++i) {
    w->lanes[ids[i]].state = RUNNABLE;
    push(w, ids[i]);
  }
}

void switch_to_lane(Worker* w, Lane* l) {
  t_lane = l;
#if MSLSIM_ASAN
  __sanitizer_start_switch_fiber(&w->sched_fake, l->stack->base, l->stack->size);
#endif
  mslsim_swap_context(&w->sched_sp, l->sp);
#if MSLSIM_ASAN
  __sanitizer_finish_switch_fiber(w->sched_fake, nullptr, nullptr);
#endif
  t_lane = nullptr;
}

void yield_to_scheduler(Worker* w, Lane* l, bool final) {
#if MSLSIM_ASAN
  __sanitizer_start_switch_fiber(final ? nullptr : &l->asan_fake, w->sched_bottom, w->sched_size);
#else
  (void)final;
#endif
  mslsim_swap_context(&l->sp, w->sched_sp);
#if MSLSIM_ASAN
  __sanitizer_finish_switch_fiber(l->asan_fake, &w->sched_bottom, &w->sched_size);
#endif
}

std::string where(Worker* w) {
  char buf[160];
  snprintf(buf, sizeof buf, "kernel '%s', threadgroup (%u,%u,%u)", w->job->k->name, w->tgpos[0], w->tgpos[1],
           w->tgpos[2]);
  return buf;
}

// Fails the running threadgroup from inside a lane and abandons that lane.
[[noreturn]] void fail_lane(Worker* w, Lane* l, const std::string& msg) {
  w->tg_failed = true;
  l->stack->dirty = true;
  w->tg_err = where(w) + ": " + msg;
  yield_to_scheduler(w, l, false);
  fprintf(stderr, "mslsim: a failed lane was resumed\n");
  abort();
}

std::string lane_list(Worker* w, int first, int count, int state) {
  std::string s;
  int n = 0;
  for (int i = first; i < first + count; ++i) {
    if (w->lanes[i].state != state) continue;
    if (n++ == 8) {
      s += ", ...";
      break;
    }
    if (!s.empty()) s += ", ";
    s += std::to_string(i);
  }
  return s;
}

void resolve_simd(Worker* w, SimdGroup& g, Lane* self) {
  void* data[MSLSIM_MAX_SIMD_WIDTH] = {};
  int wake[MSLSIM_MAX_SIMD_WIDTH];
  int nwake = 0;
  for (int i = 0; i < g.count; ++i) {
    Lane& l = w->lanes[g.first + i];
    if (&l == self) {
      data[i] = l.coll_data;
    } else if (l.state == WAIT_SIMD) {
      data[i] = l.coll_data;
      wake[nwake++] = g.first + i;
    }
  }
  g.waiting = 0;
  g.fn(data, (int)w->job->width);
  if (self && w->rng) {  // shuffled mode: the resolving lane queues up with the others
    wake[nwake++] = self->index;
    release(w, wake, nwake);  // queues self too; the scheduler resumes it in its turn
    yield_to_scheduler(w, self, false);
    return;
  }
  release(w, wake, nwake);
}

extern "C" void mslsim_lane_main(Lane* l) {
  Worker* w = t_worker;
#if MSLSIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &w->sched_bottom, &w->sched_size);
#endif
  w->job->k->entry(w->args.data());
  l->state = EXITED;
  w->exited++;
  SimdGroup& g = w->sgs[l->simd];
  g.active--;
  if (w->barrier_waiting > 0) {
    fail_lane(w, l,
              "thread " + std::to_string(l->index) + " returned while " + std::to_string(w->barrier_waiting) +
                  " other threads wait at " + describe(w->barrier_site) +
                  " (early exit before a barrier: every thread of a threadgroup must reach each barrier)");
  }
  if (g.waiting > 0 && g.waiting == g.active) {
    if (g.flags & MSLSIM_SYNC_FULL)
      fail_lane(w, l,
                "thread " + std::to_string(l->index) + " returned while its simdgroup waits at " + describe(g.site) +
                    " (simdgroup_matrix operations need all 32 lanes)");
    resolve_simd(w, g, nullptr);
  }
  yield_to_scheduler(w, l, true);
  abort();  // an exited fiber is never resumed
}

void init_fiber(Worker* w, Lane* l) {
  (void)w;
#if MSLSIM_ASAN
  if (l->stack->dirty) __asan_unpoison_memory_region(l->stack->base, l->stack->size);
#endif
  l->stack->dirty = false;
  l->asan_fake = nullptr;
  // Frame that mslsim_swap_context pops: control words, r15, r14, r13, r12 (the lane), rbx, rbp, return
  // address. The return address slot sits 8 bytes below the 16-aligned top, so the entry trampoline
  // starts with rsp 16-aligned as its `call` expects.
  uintptr_t top = ((uintptr_t)l->stack->base + l->stack->size) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)(top - 64);
  sp[0] = 0x1F80u | ((uint64_t)0x037Fu << 32);  // default MXCSR, x87 control word
  sp[1] = sp[2] = sp[3] = 0;                     // r15 r14 r13
  sp[4] = (uint64_t)(uintptr_t)l;                // r12
  sp[5] = 0;                                     // rbx
  sp[6] = 0;                                     // rbp: ends frame-pointer stack walks
  sp[7] = (uint64_t)(uintptr_t)&mslsim_fiber_entry;
  l->sp = sp;
}

void set3(uint32_t* d, uint32_t x, uint32_t y, uint32_t z) {
  d[0] = x;
  d[1] = y;
  d[2] = z;
}

void job_fail(Job* j, const std::string& msg) {
  std::lock_guard<std::mutex> lock(j->err_mu);
  if (!j->failed.load()) {
    j->err = msg;
    j->failed.store(true);
  }
}

void* threadgroup_block(void*& mem, size_t& have, size_t want) {
  if (have != want) {
    free(mem);
    mem = malloc(want ? want : 1);  // exact size: ASan reports an access past the end
    have = want;
  }
  return mem;
}

void run_threadgroup(Worker* w, Job* j, uint64_t linear) {
  const mslsim_dispatch* d = j->d;
  if (!j->order.empty()) linear = j->order[linear];
  if (d->reverse_threadgroups) linear = j->total - 1 - linear;
  w->tgpos[0] = (uint32_t)(linear % j->ntg[0]);
  w->tgpos[1] = (uint32_t)((linear / j->ntg[0]) % j->ntg[1]);
  w->tgpos[2] = (uint32_t)(linear / ((uint64_t)j->ntg[0] * j->ntg[1]));
  uint32_t size[3];
  for (int a = 0; a < 3; ++a) {
    size[a] = j->tptg[a];
    if (j->partial) {
      uint32_t start = w->tgpos[a] * j->tptg[a];
      size[a] = j->grid[a] - start < j->tptg[a] ? j->grid[a] - start : j->tptg[a];
    }
  }
  const int n = (int)(size[0] * size[1] * size[2]);
  const int width = (int)j->width;
  const int nsg = (n + width - 1) / width;

  w->job = j;
  w->nlanes = n;
  w->exited = 0;
  w->barrier_waiting = 0;
  w->tg_failed = false;
  w->tg_err.clear();
  w->serial = g_serial.fetch_add(1);
  w->tg_static_used = 0;
  w->rng = 0;
  if (d->lane_shuffle_seed) {
    w->rng = d->lane_shuffle_seed ^ (linear * 0xD1B54A32D192ED03ull);
    if (!w->rng) w->rng = 1;
  }
  for (int a = 0; a < j->k->n_args; ++a) {  // [[threadgroup(i)]] memory: poisoned for every threadgroup
    const mslsim_arg& arg = j->k->args[a];
    if (arg.kind == MSLSIM_ARG_THREADGROUP) memset(w->args[a], 0xFF, w->tg_param_size[arg.index]);
  }

  while ((int)w->stacks.size() < n) w->stacks.push_back(new_stack());
  if ((int)w->lanes.size() < n) w->lanes.resize(n);
  if ((int)w->sgs.size() < nsg) w->sgs.resize(nsg);
  if ((int)w->queue.size() < n + 1) w->queue.resize(n + 1);
  w->qhead = w->qtail = 0;

  for (int s = 0; s < nsg; ++s) {
    SimdGroup& g = w->sgs[s];
    g.first = s * width;
    g.count = n - g.first < width ? n - g.first : width;
    g.active = g.count;
    g.waiting = 0;
    g.fn = nullptr;
  }
  for (int i = 0; i < n; ++i) {
    Lane& l = w->lanes[i];
    l.stack = &w->stacks[i];
    l.state = RUNNABLE;
    l.index = i;
    l.simd = i / width;
    l.coll_data = nullptr;
    uint32_t lx = (uint32_t)i % size[0], ly = ((uint32_t)i / size[0]) % size[1],
             lz = (uint32_t)i / (size[0] * size[1]);
    mslsim_builtins& b = l.b;
    memset(&b, 0, sizeof b);
    set3(b.thread_position_in_threadgroup, lx, ly, lz);
    set3(b.thread_position_in_grid, w->tgpos[0] * j->tptg[0] + lx, w->tgpos[1] * j->tptg[1] + ly,
         w->tgpos[2] * j->tptg[2] + lz);
    set3(b.threadgroup_position_in_grid, w->tgpos[0], w->tgpos[1], w->tgpos[2]);
    set3(b.threads_per_threadgroup, size[0], size[1], size[2]);
    set3(b.threadgroups_per_grid, j->ntg[0], j->ntg[1], j->ntg[2]);
    set3(b.threads_per_grid, j->grid[0], j->grid[1], j->grid[2]);
    set3(b.dispatch_threads_per_threadgroup, j->tptg[0], j->tptg[1], j->tptg[2]);
    b.thread_index_in_threadgroup[0] = (uint32_t)i;
    b.thread_index_in_simdgroup[0] = (uint32_t)(i % width);
    b.simdgroup_index_in_threadgroup[0] = (uint32_t)(i / width);
    b.threads_per_simdgroup[0] = (uint32_t)width;
    b.simdgroups_per_threadgroup[0] = (uint32_t)nsg;
    b.thread_execution_width[0] = (uint32_t)width;
    b.thread_index_in_quadgroup[0] = (uint32_t)(i % 4);
    b.quadgroup_index_in_threadgroup[0] = (uint32_t)(i / 4);
    b.quadgroups_per_threadgroup[0] = (uint32_t)((n + 3) / 4);
    init_fiber(w, &l);
  }
  {
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    if (w->rng)
      release(w, order.data(), n);
    else
      for (int i = 0; i < n; ++i) push(w, i);
  }

  while (w->qhead != w->qtail && !w->tg_failed) {
    int li = w->queue[w->qhead];
    w->qhead = (w->qhead + 1) % w->queue.size();
    Lane* l = &w->lanes[li];
    if (l->state != RUNNABLE) continue;
    switch_to_lane(w, l);
  }
  if (!w->tg_failed && w->exited != n) {
    std::string msg = where(w) + ": deadlock: no thread can make progress;";
    for (int i = 0; i < n; ++i) {
      Lane& l = w->lanes[i];
      if (l.state == WAIT_SIMD || l.state == WAIT_BARRIER) {
        msg += " thread " + std::to_string(i) + " waits at " + describe(l.site) + ";";
        if (msg.size() > 600) break;
      }
    }
    w->tg_failed = true;
    w->tg_err = msg;
  }
  if (w->tg_failed) {
    for (int i = 0; i < n; ++i)
      if (w->lanes[i].state != EXITED) w->lanes[i].stack->dirty = true;
    job_fail(j, w->tg_err);
  }
}

// ---------------------------------------------------------------------------------------------------
// The persistent pool
// ---------------------------------------------------------------------------------------------------

struct Pool {
  std::mutex mu;
  std::condition_variable cv, done_cv;
  std::vector<Worker*> workers;
  Job* job = nullptr;
  uint64_t generation = 0;
  int busy = 0;
  bool stopping = false;
  int wanted = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: workers may still be parked in it at process exit
  return *p;
}

std::mutex& run_mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

void worker_main(Worker* w) {
  t_worker = w;
#if !MSLSIM_ASAN
  // Lanes run on small fiber stacks: a host's SIGSEGV handler (the job runner's) needs its own stack to
  // report a lane's stack overflow. ASan sets up alternate stacks itself.
  static thread_local char altstack[64 << 10];
  stack_t ss = {};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, nullptr);
#endif
  Pool& p = pool();
  uint64_t seen = 0;
  for (;;) {
    Job* j;
    {
      std::unique_lock<std::mutex> lock(p.mu);
      p.cv.wait(lock, [&] { return p.stopping || p.generation != seen; });
      if (p.stopping) return;
      seen = p.generation;
      j = p.job;
    }
    // Arguments for every lane this worker runs: buffers as bound, threadgroup memory per worker.
    w->args.assign(j->k->n_args, nullptr);
    for (int a = 0; a < j->k->n_args; ++a) {
      const mslsim_arg& arg = j->k->args[a];
      if (arg.kind == MSLSIM_ARG_BUFFER)
        w->args[a] = j->d->buffers[arg.index];
      else
        w->args[a] = threadgroup_block(w->tg_param_mem[arg.index], w->tg_param_size[arg.index],
                                       j->d->threadgroup_bytes[arg.index]);
    }
    w->traffic.clear();
    w->traffic.d = j->d->traffic ? j->d : nullptr;
    t_traffic = w->traffic.d ? &w->traffic : nullptr;
    for (;;) {
      if (j->failed.load(std::memory_order_relaxed)) break;
      uint64_t i = j->next.fetch_add(1);
      if (i >= j->total) break;
      run_threadgroup(w, j, i);
    }
    t_traffic = nullptr;
    {
      std::lock_guard<std::mutex> lock(p.mu);
      if (--p.busy == 0) p.done_cv.notify_all();
    }
  }
}

// The workers' records merged: distinct bytes per kind as maximal runs in address order, then the access sums.
void report_traffic(const mslsim_dispatch* d, const std::vector<Worker*>& workers) {
  std::unordered_map<uintptr_t, TrafficPage> merged;
  uint64_t accessed[2] = {0, 0};
  for (Worker* w : workers) {
    for (auto& [index, pg] : w->traffic.pages) {
      TrafficPage& m = merged[index];
      for (int k = 0; k < 2; ++k)
        for (int i = 0; i < 64; ++i) m.bits[k][i] |= pg->bits[k][i];
    }
    accessed[0] += w->traffic.accessed[0];
    accessed[1] += w->traffic.accessed[1];
  }
  std::vector<uintptr_t> order;
  order.reserve(merged.size());
  for (auto& [index, pg] : merged) order.push_back(index);
  std::sort(order.begin(), order.end());
  for (int k = 0; k < 2; ++k) {
    uintptr_t start = 0, end = 0;  // the pending run [start, end)
    for (uintptr_t index : order) {
      const TrafficPage& pg = merged[index];
      for (uintptr_t bit = 0; bit < 4096; ++bit) {
        if (!pg.bits[k][bit >> 6]) {
          bit |= 63;  // an empty word: skip it
          continue;
        }
        if (!(pg.bits[k][bit >> 6] >> (bit & 63) & 1)) continue;
        const uintptr_t a = (index << 12) | bit;
        if (end != a) {
          if (end != start) d->traffic(d->traffic_ctx, (const void*)start, end - start, k);
          start = a;
        }
        end = a + 1;
      }
    }
    if (end != start) d->traffic(d->traffic_ctx, (const void*)start, end - start, k);
  }
  d->traffic(d->traffic_ctx, nullptr, accessed[0], 0);
  d->traffic(d->traffic_ctx, nullptr, accessed[1], 1);
}

void ensure_workers() {
  Pool& p = pool();
  int want = p.wanted > 0 ? p.wanted : (int)std::thread::hardware_concurrency();
  if (want < 1) want = 1;
  if ((int)p.workers.size() == want) return;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.stopping = true;
  }
  p.cv.notify_all();
  for (Worker* w : p.workers) {
    w->thread.join();
    // Stacks and blocks of the old worker are simply leaked: this happens at most a few times per process.
  }
  p.workers.clear();
  p.stopping = false;
  p.generation = 0;
  for (int i = 0; i < want; ++i) {
    Worker* w = new Worker;
    p.workers.push_back(w);
    w->thread = std::thread(worker_main, w);
  }
}

int fail(char* err, size_t err_size, const std::string& msg) {
  if (err && err_size) snprintf(err, err_size, "%s", msg.c_str());
  return 1;
}

bool constant_enabled(const mslsim_library* lib, int index) {
  for (int c = 0; c < lib->n_constants; ++c) {
    const mslsim_function_constant& fc = lib->constants[c];
    if (fc.index != index) continue;
    if (!*fc.defined) return false;
    const unsigned char* v = (const unsigned char*)fc.storage;
    for (size_t b = 0; b < fc.size; ++b)
      if (v[b]) return true;
    return false;
  }
  return false;
}

}  // namespace

extern "C" {

const mslsim_builtins* mslsim_lane_builtins(void) { return t_lane ? &t_lane->b : nullptr; }

void mslsim_barrier(const char* what, const char* file, unsigned line, unsigned column) {
  Worker* w = t_worker;
  Lane* l = t_lane;
  if (!l) mslsim_fail("threadgroup_barrier called outside a kernel", file, line);
  Site s{what, file, line, column};
  if (w->exited > 0) {
    fail_lane(w, l,
              "thread " + std::to_string(l->index) + " reached " + describe(s) + " after " +
                  std::to_string(w->exited) +
                  " thread(s) of its threadgroup returned (early exit before a barrier: every thread of a "
                  "threadgroup must reach each barrier)");
  }
  if (w->barrier_waiting == 0) {
    w->barrier_site = s;
  } else if (!same_site(w->barrier_site, s)) {
    fail_lane(w, l,
              "divergent barriers: thread " + std::to_string(l->index) + " waits at " + describe(s) +
                  " while other threads wait at " + describe(w->barrier_site));
  }
  SimdGroup& g = w->sgs[l->simd];
  if (g.waiting > 0) {
    fail_lane(w, l,
              "thread " + std::to_string(l->index) + " waits at " + describe(s) + " while lanes " +
                  lane_list(w, g.first, g.count, WAIT_SIMD) + " of its simdgroup wait at " + describe(g.site) +
                  " (divergent simd_* call)");
  }
  if (++w->barrier_waiting == w->nlanes) {
    w->barrier_waiting = 0;
    std::vector<int> wake;
    wake.reserve(w->nlanes);
    for (int i = 0; i < w->nlanes; ++i)
      if (w->lanes[i].state == WAIT_BARRIER) wake.push_back(i);
    if (w->rng) {
      wake.push_back(l->index);
      release(w, wake.data(), (int)wake.size());
      yield_to_scheduler(w, l, false);
    } else {
      release(w, wake.data(), (int)wake.size());
    }
    return;
  }
  l->state = WAIT_BARRIER;
  l->site = s;
  yield_to_scheduler(w, l, false);
}

void mslsim_simd_sync(mslsim_collective_fn fn, void* data, int flags, const char* what, const char* file,
                      unsigned line, unsigned column) {
  Worker* w = t_worker;
  Lane* l = t_lane;
  if (!l) mslsim_fail("simd collective called outside a kernel", file, line);
  Site s{what, file, line, column};
  SimdGroup& g = w->sgs[l->simd];
  if (w->barrier_waiting > 0) {
    for (int i = g.first; i < g.first + g.count; ++i)
      if (w->lanes[i].state == WAIT_BARRIER)
        fail_lane(w, l,
                  "divergent simd_* call: lane " + std::to_string(l->index - g.first) + " of simdgroup " +
                      std::to_string(l->simd) + " calls " + describe(s) + " while lanes " +
                      lane_list(w, g.first, g.count, WAIT_BARRIER) + " wait at " + describe(w->barrier_site));
  }
  if ((flags & MSLSIM_SYNC_FULL) && (g.count != (int)w->job->width || g.active != g.count)) {
    fail_lane(w, l,
              describe(s) + " needs all " + std::to_string(w->job->width) + " lanes of the simdgroup, but only " +
                  std::to_string(g.active) + " are active");
  }
  if (g.waiting == 0) {
    g.site = s;
    g.fn = fn;
    g.flags = flags;
  } else if (g.fn != fn || !same_site(g.site, s)) {
    fail_lane(w, l,
              "divergent simd_* call: lane " + std::to_string(l->index - g.first) + " of simdgroup " +
                  std::to_string(l->simd) + " calls " + describe(s) + " while lanes " +
                  lane_list(w, g.first, g.count, WAIT_SIMD) + " wait at " + describe(g.site) +
                  " (all active lanes of a simdgroup must reach the same simd_* call)");
  }
  l->coll_data = data;
  if (++g.waiting == g.active) {
    resolve_simd(w, g, l);
    return;
  }
  l->state = WAIT_SIMD;
  l->site = s;
  yield_to_scheduler(w, l, false);
}

void* mslsim_tg_alloc(const void* key, size_t size, size_t align) {
  Worker* w = t_worker;
  TgBlock* b = nullptr;
  if (w->last_block < w->blocks.size() && w->blocks[w->last_block].key == key) {
    b = &w->blocks[w->last_block];
  } else {
    for (size_t i = 0; i < w->blocks.size(); ++i)
      if (w->blocks[i].key == key) {
        b = &w->blocks[i];
        w->last_block = i;
        break;
      }
  }
  if (!b) {
    w->blocks.push_back(TgBlock{key, nullptr, 0, 0});
    w->last_block = w->blocks.size() - 1;
    b = &w->blocks.back();
  }
  if (b->size != size || !b->mem) {
    free(b->mem);
    if (align < sizeof(void*)) align = sizeof(void*);
    // Exact size, separately allocated: ASan reports an access past the end of a threadgroup array.
    if (posix_memalign(&b->mem, align, size ? size : 1) != 0) abort();
    b->size = size;
    b->stamp = 0;
  }
  if (b->stamp != w->serial) {
    memset(b->mem, 0xFF, size);  // poison: NaN for floats, -1 for integers
    b->stamp = w->serial;
    // The budget, counted as declarations execute: this also covers threadgroup variables that the load-time
    // count cannot see (in member functions and lambdas).
    w->tg_static_used += round16(size);
    if (w->tg_static_used + w->job->dynamic_tg > w->job->max_tg && t_lane)
      fail_lane(w, t_lane,
                "threadgroup memory over the device limit: " + std::to_string(w->tg_static_used) +
                    " bytes of threadgroup variables reached so far + " + std::to_string(w->job->dynamic_tg) +
                    " bytes of [[threadgroup(i)]] memory > " + std::to_string(w->job->max_tg) + " bytes");
  }
  return b->mem;
}

namespace {
struct TgReg {
  const void* key;
  int decl;
  size_t size;
};
std::mutex& reg_mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::vector<TgReg>& registry() {
  static std::vector<TgReg>* r = new std::vector<TgReg>;
  return *r;
}
}  // namespace

void mslsim_tg_register(const void* key, int decl, size_t size) {
  std::lock_guard<std::mutex> lock(reg_mutex());
  for (TgReg& r : registry())
    if (r.key == key && r.decl == decl) {
      if (size > r.size) r.size = size;
      return;
    }
  registry().push_back(TgReg{key, decl, size});
}

size_t mslsim_tg_static_bytes(const void* const* keys, int n) {
  std::lock_guard<std::mutex> lock(reg_mutex());
  size_t total = 0;
  for (const TgReg& r : registry())
    for (int i = 0; i < n; ++i)
      if (r.key == keys[i]) total += round16(r.size);
  return total;
}

void mslsim_fail(const char* message, const char* file, unsigned line) {
  Worker* w = t_worker;
  Lane* l = t_lane;
  char buf[64];
  snprintf(buf, sizeof buf, ":%u", line);
  if (!w || !l) {
    fprintf(stderr, "mslsim: %s at %s%s (outside a dispatch)\n", message, file, buf);
    abort();
  }
  fail_lane(w, l, std::string(message) + " at " + file + buf);
}

void mslsim_set_workers(int workers) {
  std::lock_guard<std::mutex> lock(run_mutex());
  pool().wanted = workers;
}

int mslsim_run(const mslsim_dispatch* d, char* err, size_t err_size) {
  std::lock_guard<std::mutex> run_lock(run_mutex());
  if (!d || !d->library || !d->kernel) return fail(err, err_size, "mslsim_run: no library or kernel given");
  const mslsim_library* lib = d->library;
  const mslsim_kernel* k = d->kernel;
  if (lib->abi_version != MSLSIM_ABI_VERSION)
    return fail(err, err_size, "mslsim_run: library built for another ABI version");
  const std::string kname = std::string("kernel '") + k->name + "'";

  // Function constants first: they decide which optional arguments are used.
  for (int c = 0; c < lib->n_constants; ++c) {
    const mslsim_function_constant& fc = lib->constants[c];
    const mslsim_constant_value* v = nullptr;
    for (int i = 0; i < d->n_constants; ++i)
      if (d->constants[i].index == fc.index) v = &d->constants[i];
    if (v && v->size != fc.size) {
      return fail(err, err_size,
                  kname + ": function constant " + std::to_string(fc.index) + " '" + fc.name + "' (" + fc.type +
                      ") needs " + std::to_string(fc.size) + " bytes, got " + std::to_string(v->size));
    }
    memset(fc.storage, 0, fc.size);
    if (v) memcpy(fc.storage, v->data, fc.size);
    *fc.defined = v != nullptr;
  }
  if (lib->specialize) lib->specialize();

  for (int a = 0; a < k->n_args; ++a) {
    const mslsim_arg& arg = k->args[a];
    if (arg.enabled_by_constant >= 0 && !constant_enabled(lib, arg.enabled_by_constant)) continue;
    if (arg.index < 0 || arg.index >= MSLSIM_MAX_BINDINGS) return fail(err, err_size, kname + ": bad binding index");
    std::string what = std::string(arg.kind == MSLSIM_ARG_BUFFER ? "buffer(" : "threadgroup(") +
                       std::to_string(arg.index) + ") '" + arg.name + "' (" + arg.type + ")";
    if (arg.kind == MSLSIM_ARG_BUFFER) {
      if (!d->buffers[arg.index]) return fail(err, err_size, kname + ": " + what + " is not bound");
      if (d->buffer_bytes[arg.index] < arg.min_bytes)
        return fail(err, err_size,
                    kname + ": " + what + " is bound to " + std::to_string(d->buffer_bytes[arg.index]) +
                        " bytes but needs at least " + std::to_string(arg.min_bytes));
    } else if (d->threadgroup_bytes[arg.index] == 0) {
      return fail(err, err_size, kname + ": " + what + " has no threadgroup memory length set");
    } else if (d->threadgroup_bytes[arg.index] < arg.min_bytes) {
      return fail(err, err_size, kname + ": " + what + " is smaller than its type");
    }
  }

  Job* j = new Job;
  j->d = d;
  j->k = k;
  j->width = d->execution_width ? d->execution_width : 32;
  if (j->width > MSLSIM_MAX_SIMD_WIDTH || (j->width & (j->width - 1)) != 0) {
    delete j;
    return fail(err, err_size, kname + ": execution width must be a power of two up to 64");
  }
  uint64_t tg_threads = 1;
  for (int a = 0; a < 3; ++a) {
    j->tptg[a] = d->threads_per_threadgroup[a];
    tg_threads *= j->tptg[a];
  }
  const uint64_t max_threads =
      limit(d->max_threads_per_threadgroup, "LILY_METALSIM_MAX_THREADS_PER_THREADGROUP", kMaxThreadsPerThreadgroup);
  if (tg_threads == 0 || tg_threads > max_threads) {
    delete j;
    return fail(err, err_size,
                kname + ": threads per threadgroup must be between 1 and " + std::to_string(max_threads) + ", got " +
                    std::to_string(tg_threads));
  }
  // Threadgroup memory: the declared (static) bytes plus the [[threadgroup(i)]] lengths must fit the device.
  j->max_tg = limit(d->max_threadgroup_memory, "LILY_METALSIM_MAX_THREADGROUP_MEMORY", kMaxThreadgroupMemory);
  for (int a = 0; a < k->n_args; ++a)
    if (k->args[a].kind == MSLSIM_ARG_THREADGROUP && k->args[a].index >= 0 && k->args[a].index < MSLSIM_MAX_BINDINGS &&
        (k->args[a].enabled_by_constant < 0 || constant_enabled(lib, k->args[a].enabled_by_constant)))
      j->dynamic_tg += round16(d->threadgroup_bytes[k->args[a].index]);
  const size_t static_tg = k->static_threadgroup_bytes ? k->static_threadgroup_bytes() : 0;
  if (static_tg + j->dynamic_tg > j->max_tg) {
    const size_t dyn = j->dynamic_tg, mx = j->max_tg;
    delete j;
    return fail(err, err_size,
                kname + ": " + std::to_string(static_tg + dyn) + " bytes of threadgroup memory (" +
                    std::to_string(static_tg) + " static + " + std::to_string(dyn) +
                    " dynamic) exceed the device limit of " + std::to_string(mx) + " bytes");
  }
  j->partial = d->grid_threads[0] && d->grid_threads[1] && d->grid_threads[2];
  for (int a = 0; a < 3; ++a) {
    if (j->partial) {
      j->grid[a] = d->grid_threads[a];
      j->ntg[a] = (d->grid_threads[a] + j->tptg[a] - 1) / j->tptg[a];
    } else {
      j->ntg[a] = d->threadgroups[a];
      j->grid[a] = d->threadgroups[a] * j->tptg[a];
    }
  }
  j->total = (uint64_t)j->ntg[0] * j->ntg[1] * j->ntg[2];
  if (j->total == 0) {
    delete j;
    return 0;  // an empty grid runs nothing, as on the GPU
  }
  if (d->threadgroup_order_seed && j->total > 1) {  // a seeded permutation of the start order
    j->order.resize(j->total);
    for (uint64_t i = 0; i < j->total; ++i) j->order[i] = i;
    uint64_t rng = d->threadgroup_order_seed;
    for (uint64_t i = j->total - 1; i > 0; --i) {
      uint64_t r = splitmix(rng) % (i + 1);
      uint64_t t = j->order[i];
      j->order[i] = j->order[r];
      j->order[r] = t;
    }
  }

  ensure_workers();
  Pool& p = pool();
  {
    std::unique_lock<std::mutex> lock(p.mu);
    p.job = j;
    p.busy = (int)p.workers.size();
    p.generation++;
    p.cv.notify_all();
    p.done_cv.wait(lock, [&] { return p.busy == 0; });
    p.job = nullptr;
  }
  int rc = 0;
  if (j->failed.load()) rc = fail(err, err_size, j->err);
  else if (d->traffic) report_traffic(d, p.workers);
  for (Worker* w : p.workers) w->traffic.clear();
  delete j;
  return rc;
}

// Traffic mode: clang's -fsanitize-coverage=trace-loads,trace-stores calls these before every load and store of
// 1, 2, 4, 8 or 16 bytes of the kernel code (accesses of other sizes are not reported: metalsim.build's traffic
// mode checks the library's IR for them and refuses it). Outside a dispatch that records traffic they return.
#define MSLSIM_TRAFFIC_HOOK(kind, n, write)                                   \
  void __sanitizer_cov_##kind##n(const void* p) {                           \
    if (Traffic* t = t_traffic) t->record(uintptr_t(p), n, write);           \
  }
MSLSIM_TRAFFIC_HOOK(load, 1, 0)
MSLSIM_TRAFFIC_HOOK(load, 2, 0)
MSLSIM_TRAFFIC_HOOK(load, 4, 0)
MSLSIM_TRAFFIC_HOOK(load, 8, 0)
MSLSIM_TRAFFIC_HOOK(load, 16, 0)
MSLSIM_TRAFFIC_HOOK(store, 1, 1)
MSLSIM_TRAFFIC_HOOK(store, 2, 1)
MSLSIM_TRAFFIC_HOOK(store, 4, 1)
MSLSIM_TRAFFIC_HOOK(store, 8, 1)
MSLSIM_TRAFFIC_HOOK(store, 16, 1)
#undef MSLSIM_TRAFFIC_HOOK

// libgcc 12 has no float/double -> bfloat conversions; clang emits calls to these for __bf16.
// Round to nearest, ties to even; NaN stays a quiet NaN.
__bf16 __truncsfbf2(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t h;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    h = (uint16_t)((u >> 16) | 0x40u);
  else
    h = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}

__bf16 __truncdfbf2(double x) {
  uint64_t u;
  memcpy(&u, &x, 8);
  uint16_t h;
  if ((u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull) {
    h = (uint16_t)(((u >> 48) & 0x8000u) | 0x7FC0u);
  } else {
    // Round the double once, directly to bfloat precision (8 significant bits), then narrow exactly;
    // a result of 2^128 or more becomes infinity in the float conversion.
    double ax = x < 0 ? -x : x;
    int e;
    (void)__builtin_frexp(ax, &e);  // ax = m * 2^e, m in [0.5, 1)
    if (e < -125) e = -125;         // subnormal bfloat: the quantum stays 2^-133
    double q = __builtin_ldexp(1.0, e - 8);
    double r = __builtin_rint(ax / q) * q;  // rint rounds ties to even
    return __truncsfbf2((float)(x < 0 ? -r : r));
  }
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}

}  // extern "C"
