// The sample op on the device (oracle: csrc/cpu/sample.cpp, runtime/mt19937.h). logits [1, V] F32; sampler
// state I32: counts [1, V], seen [1, V], rng [1, 626] (mt19937_64 words), ring [R, 1], ring_count [1, 1].
//
// Launches (host: csrc/cuda/sample.cpp):
//   sample_prep      grid ceil(V / 2048) × 256 threads: penalised logit ("work") of every token as a 32-bit
//                    key D (ascending D = the CPU's candidate order: logit descending; ties by id through the
//                    id itself), written to ws, and each block's first maximum.
//   greedy:  sample_greedy    1 × 256: the first maximum over the block partials; writes the id and state.
//   Greedy rows without penalties (an MTP verify's k + 1 rows) are independent: prep over (ceil(V / 2048), T)
//   without keys, then sample_greedy takes the rows in order: two launches for T rows instead of 2T.
//   else:    sample_weights   grid as prep: the CPU's weight exp(work·(1/T) − top) of every token (ws), each
//                             block reducing the partials for top itself (no inter-block counter: ws is shared).
//            sample_select    1 × 1024 threads: the draw (see below), the id and state.
// sample_select: the twister's number first (whole block regenerates the 312-word state in two parallel
// halves when due), then the CPU's walk over a sorted prefix of up to CAP candidates (the first min(n, CAP)
// in candidate order, found by a radix descent over D and collected, then bitonic sorted in shared memory):
// total (top-k), top-p, min-p, mass and the draw. Where that walk would leave the prefix (no top-k and a flat
// distribution, top_k > CAP) the same quantities come from radix descents over all V.
// The definition is csrc/cpu/sample.cpp's, bit for bit: weights w = weight_exp(fmaf(work, 1/T, -top)) (the
// same explicit double sequence on both), every sum an exact integer sum of q = round(w * 2^F) (order-free,
// so the prefix walk, the descents and the CPU's loops agree exactly), top-p against round(top_p * Q), min-p
// on x = fmaf(work, 1/T, -top) >= float(log(min_p)) (monotone in the key, so a whole-V count is the CPU's
// prefix), the draw at R = min(round(u * M), M - 1).
// Floors: prep reads 12·V bytes (logits, seen, counts) and writes 4·V (3 MB + 1 MB at V = 248320: ~1 µs at
// 4 TB/s); weights 8·V; select 4·V per count-only pass, 8·V per weighted pass (L2-resident).
#include "common.cuh"

#define PREP_THREADS 256
#define PREP_PER_THREAD 8
#define PREP_CHUNK (PREP_THREADS * PREP_PER_THREAD)
#define SEL_THREADS 1024
#ifndef CAP
#define CAP 2048  // sorted prefix size (a power of two); must match kCap in csrc/cuda/sample.cpp
#endif
#define NBINS 2048  // radix descent: 11 + 11 + 10 bits of D

#define MT_N 312
#define MT_M 156

struct Partial {
  float v;
  int i;
};

// Penalties exactly as the CPU computes them (-march=native contracts pres + freq·count into one fma).
__device__ __forceinline__ float penalised(float x, int seen, int count, float rep, float pres, float freq,
                                           int has_rep, int has_pf) {
  if (has_rep && seen) x = x > 0.f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
  if (has_pf && count) x = __fsub_rn(x, fmaf(float(count), freq, pres));
  return x;
}

// Key order: ascending D ⇔ descending float (-0 taken as +0: the CPU's == ties them).
__device__ __forceinline__ u32 key_of(float f) {
  u32 u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0u;
  const u32 o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~o;
}
__device__ __forceinline__ float work_of(u32 d) {
  const u32 o = ~d;
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ void block_best(float& v, int& i, Partial* scratch) {  // scratch: 32 entries
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = Partial{v, i};
  __syncthreads();
  if (lane < warps) {
    v = scratch[lane].v, i = scratch[lane].i;
  } else {
    v = -__int_as_float(0x7f800000), i = 0x7fffffff;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
}

// Row blockIdx.y of the logits (greedy rows without penalties: independent, one launch for all; every other
// call has one row). keys == nullptr: not written (greedy reads only the partials); partials of row y at y·G.
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
    sample_prep(const float* __restrict__ logits, i64 logits_stride, const int* __restrict__ seen,
                const int* __restrict__ counts, u32* __restrict__ keys, Partial* __restrict__ partials, int V,
                float rep, float pres, float freq, int has_rep, int has_pf) {
  LILY_PDL_PROLOGUE();
  __shared__ Partial scratch[32];
  float bv = -__int_as_float(0x7f800000);
  int bi = 0x7fffffff;
  const int base = blockIdx.x * PREP_CHUNK;
  logits += i64(blockIdx.y) * logits_stride;
#pragma unroll
  for (int j = 0; j < PREP_PER_THREAD; ++j) {
    const int i = base + j * PREP_THREADS + threadIdx.x;
    if (i < V) {
      const float x = penalised(logits[i], has_rep ? seen[i] : 0, has_pf ? counts[i] : 0, rep, pres, freq, has_rep,
                                has_pf);
      if (keys) keys[i] = key_of(x);
      if (better(x, i, bv, bi)) bv = x, bi = i;
    }
  }
  block_best(bv, bi, scratch);
  if (threadIdx.x == 0) partials[i64(blockIdx.y) * gridDim.x + blockIdx.x] = Partial{bv, bi};
}

struct FinishArgs {
  u64 counts, seen, ring, ring_count, next_id;
  i64 ring_rows, ring_stride;
};

// The CPU's bookkeeping after a choice (one thread).
__device__ void finish(int id, const FinishArgs& a) {
  int* counts = reinterpret_cast<int*>(a.counts);
  int* seen = reinterpret_cast<int*>(a.seen);
  int* ring = reinterpret_cast<int*>(a.ring);
  int* rc = reinterpret_cast<int*>(a.ring_count);
  counts[id] += 1;
  seen[id] = 1;
  const int n = *rc;
  ring[i64(n % int(a.ring_rows)) * a.ring_stride] = id;
  *rc = n + 1;
  *reinterpret_cast<int*>(a.next_id) = id;
}

__device__ void reduce_partials(const Partial* __restrict__ partials, int G, float& bv, int& bi, Partial* scratch) {
  bv = -__int_as_float(0x7f800000), bi = 0x7fffffff;
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    const Partial p = partials[g];
    if (better(p.v, p.i, bv, bi)) bv = p.v, bi = p.i;
  }
  block_best(bv, bi, scratch);
}

// Rows 0 .. T-1 in order, as T calls would take them (ids to next_id row r, the ring in row order).
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
    sample_greedy(const Partial* __restrict__ partials, int G, int T, i64 next_stride, FinishArgs fa) {
  LILY_PDL_PROLOGUE();
  __shared__ Partial scratch[32];
  const u64 next_id = fa.next_id;
  for (int r = 0; r < T; ++r) {
    float bv;
    int bi;
    reduce_partials(partials + i64(r) * G, G, bv, bi, scratch);
    if (threadIdx.x == 0) {
      fa.next_id = next_id + u64(i64(r) * next_stride) * sizeof(int);
      finish(bi == 0x7fffffff ? 0 : bi, fa);
    }
  }
}

// csrc/cpu/sample.cpp's weight_exp, operation for operation (explicit roundings: nothing to contract).
__device__ __forceinline__ float weight_exp(float xf) {
  if (xf != xf) return xf;
  if (xf < -104.f) return 0.f;
  if (xf > 89.f) return __int_as_float(0x7f800000);
  const double x = xf;
  const i64 ki = __double2ll_rn(__dmul_rn(x, 1.4426950408889634));
  const double k = double(ki);
  double r = __fma_rn(-k, 0.6931471805599453, x);
  r = __fma_rn(-k, 2.3190468138462996e-17, r);
  double e = 1.6059043836821613e-10;
  e = __fma_rn(e, r, 2.08767569878681e-09);
  e = __fma_rn(e, r, 2.505210838544172e-08);
  e = __fma_rn(e, r, 2.755731922398589e-07);
  e = __fma_rn(e, r, 2.7557319223985893e-06);
  e = __fma_rn(e, r, 2.48015873015873e-05);
  e = __fma_rn(e, r, 0.0001984126984126984);
  e = __fma_rn(e, r, 0.001388888888888889);
  e = __fma_rn(e, r, 0.008333333333333333);
  e = __fma_rn(e, r, 0.041666666666666664);
  e = __fma_rn(e, r, 0.16666666666666666);
  e = __fma_rn(e, r, 0.5);
  e = __fma_rn(e, r, 1.0);
  e = __fma_rn(e, r, 1.0);
  return __double2float_rn(__dmul_rn(e, __longlong_as_double((ki + 1023) << 52)));  // 2^k: k in [-151, 129]
}
__device__ __forceinline__ float x_of(float work, float inv_t, float top) { return fmaf(work, inv_t, -top); }

extern "C" __global__ void __launch_bounds__(PREP_THREADS)
    sample_weights(const u32* __restrict__ keys, const Partial* __restrict__ partials, int G,
                   float* __restrict__ wts, int V, float inv_t) {
  LILY_PDL_PROLOGUE();
  __shared__ Partial scratch[32];
  float bv;
  int bi;
  reduce_partials(partials, G, bv, bi, scratch);
  const float top = __fmul_rn(bv, inv_t);  // work[idx[0]] * inv_t
  const int base = blockIdx.x * PREP_CHUNK;
#pragma unroll
  for (int j = 0; j < PREP_PER_THREAD; ++j) {
    const int i = base + j * PREP_THREADS + threadIdx.x;
    if (i < V) wts[i] = weight_exp(x_of(work_of(keys[i]), inv_t, top));
  }
}

// ---------------------------------------------------------------------------------------------------------
// sample_select

struct SelectArgs {
  u64 keys, wts, rng;
  FinishArgs fa;
  int V, n;  // n: the top-k cut (V when off)
  float top_p, inv_t, min_x;  // min_x: float(log(min_p)), the min-p bound on x
  int has_min_p;
  double fix;  // 2^F, F = min(44, 62 - bit_length(V)): V * 2^F * 2 <= 2^63
};

// q: a weight in fixed point (the CPU's Candidates::q).
__device__ __forceinline__ u64 fixq(float w, double fix) {
  return w > 0.f && w <= 2.f ? __double2ull_rn(__dmul_rn(double(w), fix)) : 0ull;
}
__device__ __forceinline__ u64 round_u64(double v) { return __double2ull_rn(v); }

struct Sel {  // result of a radix descent
  int found;
  u32 D;       // the group: every token with this key
  u32 bc, gc;  // tokens before the group (in candidate order), tokens in it
  u64 bw, gw;  // their fixed-point weight sums
};

struct Smem {
  u32 hist_c[NBINS];
  u64 hist_w[NBINS];
  u64 cand[CAP];   // (D << 32 | id), sorted ascending = candidate order
  float cw[CAP];   // weight of cand[j]
  u32 mt[2 * MT_N + 2];
  u32 wc[32];
  u64 ww[32];
  Sel sel;
  int ncand, flag, id;
  double u;  // the canonical draw
};
#define SELECT_SMEM (60 * 1024)  // must match kSelectSmem in csrc/cuda/sample.cpp
static_assert(sizeof(Smem) <= SELECT_SMEM, "sample_select shared memory");

__device__ __forceinline__ u64 mt_get(const u32* w, int i) { return u64(w[2 * i]) | (u64(w[2 * i + 1]) << 32); }
__device__ __forceinline__ void mt_put(u32* w, int i, u64 v) {
  w[2 * i] = u32(v);
  w[2 * i + 1] = u32(v >> 32);
}
__device__ __forceinline__ u64 mt_twist(u64 cur, u64 nxt, u64 far) {
  const u64 upper = ~u64(0) << 31, lower = ~upper;
  const u64 y = (cur & upper) | (nxt & lower);
  return far ^ (y >> 1) ^ ((y & 1) ? 0xB5026F5AA96619E9ull : 0ull);
}

// One mt::canonical() on the state words in global memory (the whole block calls it).
__device__ void mt_canonical(u32* g, Smem& s) {
  for (int i = threadIdx.x; i < 2 * MT_N + 2; i += blockDim.x) s.mt[i] = g[i];
  __syncthreads();
  const bool regen = s.mt[2 * MT_N] >= u32(MT_N);
  if (regen) {
    // mt::next regenerates k = 0..311 in order: k < 156 reads only old words (k + 1 and k + 156 are not yet
    // rewritten); k ≥ 156 reads word k - 156 already rewritten, and k = 311 reads the new word 0.
    u64 v = 0;
    const int k = threadIdx.x;
    if (k < MT_M) v = mt_twist(mt_get(s.mt, k), mt_get(s.mt, k + 1), mt_get(s.mt, k + MT_M));
    __syncthreads();
    if (k < MT_M) mt_put(s.mt, k, v);
    __syncthreads();
    if (k >= MT_M && k < MT_N) v = mt_twist(mt_get(s.mt, k), mt_get(s.mt, (k + 1) % MT_N), mt_get(s.mt, k - MT_M));
    __syncthreads();
    if (k >= MT_M && k < MT_N) mt_put(s.mt, k, v);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const u32 idx = regen ? 0u : s.mt[2 * MT_N];
    u64 z = mt_get(s.mt, int(idx));
    z ^= (z >> 29) & 0x5555555555555555ull;
    z ^= (z << 17) & 0x71D67FFFEDA60000ull;
    z ^= (z << 37) & 0xFFF7EEE000000000ull;
    z ^= z >> 43;
    const double r = __ull2double_rn(z) / 18446744073709551616.0;
    s.u = r >= 1.0 ? 0.99999999999999988898 : r;
    s.mt[2 * MT_N] = idx + 1;
  }
  __syncthreads();
  if (regen) {
    for (int i = threadIdx.x; i < 2 * MT_N; i += blockDim.x) g[i] = s.mt[i];
  }
  if (threadIdx.x == 0) g[2 * MT_N] = s.mt[2 * MT_N];
}

// Block-wide exclusive scan of (count, weight) pairs; every thread passes its own pair.
__device__ void block_scan2(u32 c, u64 w, u32& ec, u64& ew, Smem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 ic = c;
  u64 iw = w;
  for (int o = 1; o < 32; o <<= 1) {
    const u32 tc = __shfl_up_sync(0xffffffffu, ic, o);
    const u64 tw = __shfl_up_sync(0xffffffffu, iw, o);
    if (lane >= o) ic += tc, iw += tw;
  }
  __syncthreads();
  if (lane == 31) s.wc[warp] = ic, s.ww[warp] = iw;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    u32 xc = lane < warps ? s.wc[lane] : 0u;
    u64 xw = lane < warps ? s.ww[lane] : 0ull;
    for (int o = 1; o < 32; o <<= 1) {
      const u32 tc = __shfl_up_sync(0xffffffffu, xc, o);
      const u64 tw = __shfl_up_sync(0xffffffffu, xw, o);
      if (lane >= o) xc += tc, xw += tw;
    }
    if (lane < warps) s.wc[lane] = xc - (lane < warps ? s.wc[lane] : 0u), s.ww[lane] = xw - s.ww[lane];
  }
  __syncthreads();
  ec = s.wc[warp] + ic - c;
  ew = s.ww[warp] + iw - w;
}

__device__ u64 block_sum_u64(u64 v, Smem& s) {  // every thread gets the sum
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) s.ww[warp] = v;
  __syncthreads();
  v = lane < warps ? s.ww[lane] : 0ull;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // s.ww is reused by the next scan
  return v;
}

// Radix descent over the keys to the group where a prefix condition over candidate order first holds:
//   mode 0 (rank):   tokens before + in ≥ target + 1 (the group holding rank `target`)
//   mode 1 (weight): weight before + in ≥ target          mode 2: weight before + in > target
// Weights are q sums; a rank descent sums them too when `weighed` (s.sel.bw, s.sel.gw are 0 otherwise).
// Returns s.sel (found = 0 when no group satisfies it: the target lies past every token).
__device__ void descend(const u32* __restrict__ keys, const float* __restrict__ wts, int V, int mode, u64 target,
                        bool weighed, double fix, Smem& s) {
  const bool with_w = mode != 0 || weighed;
  u32 prefix = 0, mask = 0, bc = 0;
  u64 bw = 0;
  for (int level = 0; level < 3; ++level) {  // digits: bits 31..21, 20..10, 9..0
    const int sh = level == 0 ? 21 : level == 1 ? 10 : 0, nb = level < 2 ? 2048 : 1024;
    for (int b = threadIdx.x; b < NBINS; b += blockDim.x) s.hist_c[b] = 0u, s.hist_w[b] = 0ull;
    if (threadIdx.x == 0) s.flag = 0;
    __syncthreads();
    for (int i0 = 0; i0 < V; i0 += blockDim.x) {  // uniform trip count: the warp votes below
      const int i = i0 + threadIdx.x;
      const u32 d = i < V ? keys[i] : 0u;
      const bool in = i < V && (d & mask) == prefix;
      const u32 b = (d >> sh) & u32(nb - 1);
      // Warp-aggregated counts: tokens of one warp often share a bin (few exponents hold most logits).
      const u32 act = __ballot_sync(0xffffffffu, in);
      if (in) {
        const u32 peers = __match_any_sync(act, b);
        if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&s.hist_c[b], u32(__popc(peers)));
        if (with_w) atomicAdd(&s.hist_w[b], fixq(wts[i], fix));
      }
    }
    __syncthreads();
    // Each thread owns NBINS / blockDim.x consecutive bins (only the first nb are live).
    const int per = NBINS / blockDim.x, b0 = threadIdx.x * per;
    u32 c = 0;
    u64 w = 0;
    for (int j = 0; j < per; ++j) c += s.hist_c[b0 + j], w += s.hist_w[b0 + j];
    u32 ec;
    u64 ew;
    block_scan2(c, w, ec, ew, s);
    u64 cc = u64(bc) + ec, cw = bw + ew;
    for (int j = 0; j < per && b0 + j < nb; ++j) {
      const u64 nc = cc + s.hist_c[b0 + j], nw = cw + s.hist_w[b0 + j];
      const bool before = mode == 0 ? cc > target : mode == 1 ? cw >= target : cw > target;
      const bool after = mode == 0 ? nc > target : mode == 1 ? nw >= target : nw > target;
      if (after && !before && s.hist_c[b0 + j] > 0) {
        s.flag = 1;  // exactly one bin crosses
        s.sel.D = u32(b0 + j);
        s.sel.bc = u32(cc);
        s.sel.bw = cw;
        s.sel.gc = s.hist_c[b0 + j];
        s.sel.gw = s.hist_w[b0 + j];
      }
      cc = nc, cw = nw;
    }
    __syncthreads();
    if (!s.flag) {
      if (threadIdx.x == 0) s.sel.found = 0;
      __syncthreads();
      return;
    }
    prefix |= s.sel.D << sh;
    mask |= u32(nb - 1) << sh;
    bc = s.sel.bc;
    bw = s.sel.bw;
    __syncthreads();
  }
  if (threadIdx.x == 0) s.sel.found = 1, s.sel.D = prefix;
  __syncthreads();
}

// The id of the t-th token (0-based, id order) among those with key D (the whole block; result in s.id).
__device__ void nth_of_group(const u32* __restrict__ keys, int V, u32 D, u32 t, Smem& s) {
  const int chunk = (V + blockDim.x - 1) / blockDim.x;
  const int lo = min(V, int(threadIdx.x) * chunk), hi = min(V, lo + chunk);
  u32 c = 0;
  for (int i = lo; i < hi; ++i) c += keys[i] == D;
  u32 ec;
  u64 ew;
  block_scan2(c, 0ull, ec, ew, s);
  if (t >= ec && t < ec + c) {
    u32 k = ec;
    for (int i = lo; i < hi; ++i)
      if (keys[i] == D) {
        if (k == t) {
          s.id = i;
          break;
        }
        ++k;
      }
  }
  __syncthreads();
}

// Id of the token at candidate rank r (the whole block).
__device__ int id_at_rank(const u32* keys, const float* wts, int V, u32 r, Smem& s) {
  if (r < u32(s.ncand)) return int(u32(s.cand[r]));
  descend(keys, wts, V, 0, r, false, 0.0, s);
  nth_of_group(keys, V, s.sel.D, r - s.sel.bc, s);
  return s.id;
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS) sample_select(SelectArgs a) {
  LILY_PDL_PROLOGUE();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const u32* keys = reinterpret_cast<const u32*>(a.keys);
  const float* wts = reinterpret_cast<const float*>(a.wts);
  const int V = a.V, n = a.n;

  mt_canonical(reinterpret_cast<u32*>(a.rng), s);  // every sampled draw takes exactly one number

  // 1. The first m = min(n, CAP) candidates, exactly (ties at the boundary by id).
  const int m = min(n, CAP);
  u32 gD = 0, gt = 0;
  int gid = 0;
  bool all = m >= V;
  if (!all) {
    descend(keys, wts, V, 0, u32(m), false, 0.0, s);  // the group holding rank m (the first token left out)
    gD = s.sel.D;
    gt = u32(m) - s.sel.bc;
    if (gt > 0) {
      nth_of_group(keys, V, gD, gt, s);
      gid = s.id;
    }
  }
  if (threadIdx.x == 0) s.ncand = 0;
  for (int j = threadIdx.x; j < CAP; j += blockDim.x) s.cand[j] = ~0ull;
  __syncthreads();
  u64 rest = 0;  // q sum of the tokens left out (no top-k: part of the total)
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const u32 d = keys[i];
    const bool in = all || d < gD || (d == gD && gt > 0 && i < gid);
    if (in) {
      const int slot = atomicAdd(&s.ncand, 1);
      if (slot < CAP) s.cand[slot] = (u64(d) << 32) | u32(i);  // exactly min(m, V) arrive
    } else if (n >= V) {
      rest += fixq(wts[i], a.fix);
    }
  }
  rest = block_sum_u64(rest, s);
  // Bitonic sort of CAP composite keys (unique, so the order is the CPU's total order).
  for (int k = 2; k <= CAP; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < CAP; i += blockDim.x) {
        const int p = i ^ j;
        if (p > i) {
          const u64 x = s.cand[i], y = s.cand[p];
          if ((x > y) == ((i & k) == 0)) s.cand[i] = y, s.cand[p] = x;
        }
      }
      __syncthreads();
    }
  const int mc = min(s.ncand, CAP);  // == min(m, V)
  for (int j = threadIdx.x; j < mc; j += blockDim.x) s.cw[j] = wts[u32(s.cand[j])];
  __syncthreads();
  // top: the CPU's work[idx[0]] * (1/T) (sample_weights' top up to the sign of a zero, which x ignores)
  const float top = __fmul_rn(work_of(u32(s.cand[0] >> 32)), a.inv_t);
  const double fix = a.fix;

  // 2. The CPU's walk (thread 0), with whole-vocabulary descents where it leaves the prefix. Every flag a
  // thread 0 section sets is read by all after a barrier, and the next section starts after another.
  __shared__ u64 sh_total, sh_mass;
  __shared__ int sh_keep_p, sh_keep, sh_need;
  if (threadIdx.x == 0) {
    u64 total = n >= V ? rest : 0ull;  // a top-k cut: the first n in order; else every token
    for (int j = 0; j < mc; ++j) total += fixq(s.cw[j], fix);
    sh_total = total;
    sh_need = n < V && n > mc;  // top_k > CAP: the total from a descent
  }
  __syncthreads();
  if (__syncthreads_or(sh_need)) {
    descend(keys, wts, V, 0, u32(n), true, fix, s);  // the group holding rank n (the first token cut)
    if (threadIdx.x == 0) sh_total = s.sel.bw + u64(u32(n) - s.sel.bc) * (s.sel.gw / s.sel.gc);
    __syncthreads();
  }
  const u64 total = sh_total;
  // top-p: the least keep >= 1 whose q sum reaches round(top_p * Q)
  const u64 target_p = a.top_p > 0.f ? round_u64(double(a.top_p) * __ull2double_rn(total)) : 0ull;
  if (threadIdx.x == 0) {
    sh_need = 0;
    if (a.top_p >= 1.f) {
      sh_keep_p = n;
    } else {
      u64 cum = 0;
      int keep = 0;
      for (;;) {
        if (keep == mc && mc < n) {
          sh_need = 1;
          break;
        }
        cum += fixq(s.cw[keep], fix);
        ++keep;
        if (cum >= target_p || keep == n) break;
      }
      sh_keep_p = keep;
    }
  }
  __syncthreads();
  if (__syncthreads_or(sh_need)) {  // target_p > the prefix's sum >= 0
    descend(keys, wts, V, 1, target_p, false, fix, s);
    if (threadIdx.x == 0) {
      int keep = n;
      if (s.sel.found) {
        const u64 fg = s.sel.gw / s.sel.gc, need = target_p - s.sel.bw;  // bw < target <= bw + gw: fg > 0
        u64 t = (need + fg - 1) / fg - 1;
        if (t >= s.sel.gc) t = s.sel.gc - 1;
        keep = min(n, int(s.sel.bc + u32(t)) + 1);
      }
      sh_keep_p = keep;
    }
    __syncthreads();
  }
  // min-p: x falls along candidate order, so the tokens with x >= min_x are a prefix
  if (threadIdx.x == 0) {
    sh_need = 0;
    const int keep_p = sh_keep_p;
    int k = keep_p;
    if (a.has_min_p) {
      k = 1;
      while (k < keep_p && k < mc && x_of(work_of(u32(s.cand[k] >> 32)), a.inv_t, top) >= a.min_x) ++k;
      if (k < keep_p && k == mc) sh_need = 1;
    }
    sh_keep = k;
  }
  __syncthreads();
  if (__syncthreads_or(sh_need)) {
    u32 c = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) c += x_of(work_of(keys[i]), a.inv_t, top) >= a.min_x;
    u32 ec;
    u64 ew;
    block_scan2(c, 0ull, ec, ew, s);
    if (threadIdx.x == blockDim.x - 1) sh_keep = min(sh_keep_p, max(1, int(ec + c)));
    __syncthreads();
  }
  const int keep = sh_keep;
  // mass M and the draw: the first candidate whose running q sum exceeds R = min(round(u * M), M - 1)
  if (keep <= mc) {
    if (threadIdx.x == 0) {
      u64 mass = 0;
      for (int i = 0; i < keep; ++i) mass += fixq(s.cw[i], fix);
      int choice = int(u32(s.cand[0]));
      if (mass > 0) {
        u64 r = round_u64(s.u * __ull2double_rn(mass));
        if (r >= mass) r = mass - 1;
        u64 cum = 0;
        for (int i = 0; i < keep; ++i) {
          cum += fixq(s.cw[i], fix);
          if (cum > r) {
            choice = int(u32(s.cand[i]));
            break;
          }
        }
      }
      finish(choice, a.fa);
    }
    return;
  }
  if (keep < n) {  // uniform: keep and n are the same in every thread
    descend(keys, wts, V, 0, u32(keep), true, fix, s);  // the group holding rank keep (the first token cut)
    if (threadIdx.x == 0) sh_mass = s.sel.bw + u64(u32(keep) - s.sel.bc) * (s.sel.gw / s.sel.gc);
  } else if (threadIdx.x == 0) {
    sh_mass = total;  // keep == n: the total is the q sum of the first n
  }
  __syncthreads();
  const u64 mass = sh_mass;
  if (mass == 0) {
    if (threadIdx.x == 0) finish(int(u32(s.cand[0])), a.fa);
    return;
  }
  u64 r = round_u64(s.u * __ull2double_rn(mass));
  if (r >= mass) r = mass - 1;
  descend(keys, wts, V, 2, r, false, fix, s);  // found: the q sum of the first keep is mass > r
  u32 rank = u32(keep - 1);
  if (s.sel.found) {
    const u64 fg = s.sel.gw / s.sel.gc;  // bw <= r < bw + gw: fg > 0
    u64 t = (r - s.sel.bw) / fg;
    if (t >= s.sel.gc) t = s.sel.gc - 1;
    rank = min(rank, s.sel.bc + u32(t));
  }
  const int choice = id_at_rank(keys, wts, V, rank, s);
  if (threadIdx.x == 0) finish(choice, a.fa);
}
