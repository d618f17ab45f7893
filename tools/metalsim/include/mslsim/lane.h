// The interface between kernel code (the metal_stdlib shim compiled into a kernel library) and libmslsim:
// per-lane builtins, synchronisation points (threadgroup barriers, simdgroup collectives) and threadgroup
// storage. Internal to the emulator (hosts use abi.h); kernel libraries are rebuilt whenever it changes
// because the library cache key covers every file under include/.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSLSIM_MAX_SIMD_WIDTH 64

// The values of the builtin kernel-parameter attributes for the running lane. Scalars use [0].
typedef struct mslsim_builtins {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];  // this threadgroup's size (smaller at a dispatchThreads edge)
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t dispatch_threads_per_threadgroup[3];  // the size given to the dispatch
  uint32_t thread_index_in_threadgroup[3];
  uint32_t thread_index_in_simdgroup[3];
  uint32_t simdgroup_index_in_threadgroup[3];
  uint32_t threads_per_simdgroup[3];
  uint32_t simdgroups_per_threadgroup[3];
  uint32_t thread_execution_width[3];
  uint32_t thread_index_in_quadgroup[3];
  uint32_t quadgroup_index_in_threadgroup[3];
  uint32_t quadgroups_per_threadgroup[3];
  uint32_t grid_origin[3];
} mslsim_builtins;

const mslsim_builtins* mslsim_lane_builtins(void);

// A simdgroup collective: the last lane of the simdgroup to arrive calls fn once with every lane's data
// pointer (NULL for lanes that have exited or do not exist in a partial simdgroup); fn writes each
// lane's result through its pointer. The call returns when the collective has resolved.
typedef void (*mslsim_collective_fn)(void* const* lane_data, int width);

enum mslsim_sync_flags {
  MSLSIM_SYNC_FULL = 1,  // every lane of a full-width simdgroup must take part (simdgroup_matrix)
};

void mslsim_simd_sync(mslsim_collective_fn fn, void* data, int flags, const char* what, const char* file,
                      unsigned line, unsigned column);

// threadgroup_barrier: returns when every lane of the threadgroup waits at the same barrier.
void mslsim_barrier(const char* what, const char* file, unsigned line, unsigned column);

// Storage of a `threadgroup T x[N];` declaration: one block per (declaration, worker thread), refilled
// with 0xFF bytes the first time the declaration runs in each threadgroup.
void* mslsim_tg_alloc(const void* key, size_t size, size_t align);

// Static threadgroup memory, recorded when a kernel library is loaded: every `threadgroup T x[N];`
// declaration registers its size under the identity of its enclosing function (one key per kernel
// instantiation, one per same-file helper). The largest size per (key, declaration) counts.
void mslsim_tg_register(const void* key, int decl, size_t size);
// Sum of the registered sizes of the given keys, each rounded up to 16 bytes as Metal allocates them.
size_t mslsim_tg_static_bytes(const void* const* keys, int n);

// Fails the dispatch from kernel code (misuse that the shim detects); does not return.
void mslsim_fail(const char* message, const char* file, unsigned line) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
