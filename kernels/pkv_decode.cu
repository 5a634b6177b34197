// PersistentKV split decode over a paged KV cache (NHD), with the merge of partial states.
//
// Device code only: every decision (which items exist, how many splits, which launches) is made
// by the planner (src/persistentkv/plan.py on the host, pkv_plan below on the device); these
// kernels execute items.
//
// Configuration, fixed per compiled module by macros (the engine compiles one module per
// (dtype, head_dim, warps)):
//   PKV_HEAD_DIM   64 | 128 | 256
//   PKV_BF16       0 -> fp16 (__half), 1 -> bf16 (__nv_bfloat16)
//   PKV_WARPS      4 (default) | 8 (head_dim <= 128 only)
//
// One CTA runs one work item (row, kv head, token range [lo, hi)) for ALL G = Hq/Hkv query
// heads of that kv head, so each K/V byte is read from HBM once. WARPS warps; a pipeline stage is
// a tile of 16 * WARPS tokens (16 per warp); K and V tiles stream into shared memory with
// cp.async (16-byte chunks, XOR-swizzled so ldmatrix is bank-conflict free), STAGES deep.
//
// Math per warp and tile, on tensor cores (mma.m16n8k16, fp32 accumulate):
//   S[16 x 16] = Q[16 x D] K^T      rows = query heads (G <= 16, rows >= G are zero padding),
//                                   cols = the warp's 16 tokens
//   online softmax in base 2 (scale * log2(e) folded into S)
//   O[16 x D] += P[16 x 16] V[16 x D]
// then the WARPS warps' states are combined through shared memory. An item that is its row's only
// split writes the output directly; otherwise it writes a partial state (o normalised, lse in
// log2 units) to slot = item index, and the merge combines the slots of a (row, kv head):
//   M = max_s lse_s;  w_s = 2^(lse_s - M);  out = sum_s w_s o_s / sum_s w_s   (0 if all empty)
// either in a separate launch (pkv_merge) or fused: the last CTA of a group to finish (an
// atomic counter per (row, kv head), reset by that CTA) merges it.
//
// Napkin math (H200, Hq=32, Hkv=8, D=128, fp16): a token costs 2*8*128*2 = 4 KB of K+V over all
// heads; a 64-token stage of one kv head is 32 KB; 3 stages = 96 KB of shared memory, so two
// CTAs per SM keep up to ~128 KB of loads in flight per SM, well above the ~35 KB that
// 4.5 TB/s x ~1 us latency / 132 SMs needs. With 8 warps a stage is 128 tokens (64 KB) and
// 3 stages take 192 KB, so one CTA per SM keeps the same bytes in flight as two 4-warp CTAs: the
// variant for grids of one CTA per SM (the cluster route's one wave).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef PKV_HEAD_DIM
#define PKV_HEAD_DIM 128
#endif
#ifndef PKV_BF16
#define PKV_BF16 0
#endif
#ifndef PKV_WARPS
#define PKV_WARPS 4
#endif
// Development instrumentation (benchmarks/trace_cta.py), 0 in every module the engine ships: each
// CTA of pkv_decode / pkv_decode_fused appends one record of timestamps to pkv_trace.
#ifndef PKV_TMA
#define PKV_TMA 0  // 1 (development, sm_90, head_dim 128, page >= 16): K/V tiles by TMA, see decode_item
#endif
#ifndef PKV_TRACE
#define PKV_TRACE 0  // 1: the phases below; 2: stamps 4 and 5 inside the cross-warp combine instead
#endif
#ifndef PKV_POOL
#define PKV_POOL 0  // 1: the fused queue's pool code (DecodeEngine(pool=...) builds it; opt-in, NOTES v15)
#endif
#ifndef PKV_POOL_NOCLAIM
#define PKV_POOL_NOCLAIM 0  // 1 (development, with PKV_POOL=1): no claims in the loop (for an A/B of its cost)
#endif
#ifndef PKV_POOL_NOPROLOGUE
#define PKV_POOL_NOPROLOGUE 0  // 1 (development, with PKV_POOL=1): no claims before the loop (the same)
#endif
#ifndef PKV_EARLY_STAGES
#define PKV_EARLY_STAGES 0  // N > 0 (development): early K/V loads of the first min(N, STAGES - 1) tiles only
#endif
#ifndef PKV_L2HINT
#define PKV_L2HINT 0  // 128 | 256 (development): cp.async with that L2 prefetch size
#endif
#ifndef PKV_RING_STATIC
#define PKV_RING_STATIC 0  // 1 (development): the pool's ring in static shared memory, before the pipeline
#endif
#ifndef PKV_HEADSPLIT
// N > 1 (development, benchmarks/bench_defines.py heads=N; not TMA): the items name virtual kv
// heads h' = h * N + s, each with G / N of kv head h's query heads (the planner sees Hkv * N kv
// heads), and read K/V of kv head h' / N. The N CTAs of one kv head read the same K/V bytes at
// about the same time, so all but the first should find them in L2; a group that fills the wave
// this way needs no split of its tokens, hence no merge (NOTES, v20).
#define PKV_HEADSPLIT 1
#endif

#if PKV_BF16
typedef __nv_bfloat16 kv_t;
typedef __nv_bfloat162 kv2_t;
#else
typedef __half kv_t;
typedef __half2 kv2_t;
#endif

namespace pkv {

constexpr int D = PKV_HEAD_DIM;
constexpr int WARPS = PKV_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int TILE = 16 * WARPS;                 // tokens per pipeline stage
constexpr int CHUNKS = D / 8;                    // 16-byte chunks per token row of one head
constexpr int ROWS_PER_PASS = THREADS / CHUNKS;  // token rows one pass of all threads loads
constexpr int LOADS = TILE / ROWS_PER_PASS;      // chunks per thread per tile (each of K and V)
constexpr int STAGES = (D == 256) ? 2 : 3;
constexpr int STAGE_ELEMS = TILE * D;            // elements of K (or V) per stage
constexpr int NT = D / 8;                        // n-tiles of 8 dims in the output
constexpr int OBUF_STRIDE = D + 8;               // padded row of the cross-warp buffer (floats)
// Q fragments live in registers (D/4 of them per thread) except at D = 256, where they would
// push the thread past 255 registers: there Q sits in shared memory and is read by ldmatrix.
constexpr bool Q_SMEM = D >= 256;
constexpr int Q_ELEMS = Q_SMEM ? 16 * D : 0;

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
static_assert(WARPS == 4 || WARPS == 8, "PKV_WARPS must be 4 or 8");
// 8 warps at D = 256 would need 2 stages x 2 x 128 tokens x 256 x 2 B = 256 KB of shared memory.
static_assert(WARPS == 4 || D <= 128, "PKV_WARPS=8 needs head_dim <= 128");
// Minimum resident CTAs per SM promised to ptxas (__launch_bounds__): two 4-warp CTAs or one
// 8-warp CTA, 256 threads either way, so the register cap stays 255 per thread; two 8-warp CTAs
// would cap it at 128 and the decode kernels (158-199 registers) would spill.
constexpr int MIN_BLOCKS = WARPS == 4 ? 2 : 1;
static_assert(THREADS % CHUNKS == 0 && TILE % ROWS_PER_PASS == 0, "load mapping");

// Shared memory of the decode kernel: the K/V pipeline, reused after the loop for the
// cross-warp combine (WARPS x 16 rows x OBUF_STRIDE floats + small row arrays).
constexpr int PIPE_BYTES = (Q_ELEMS + 2 * STAGES * STAGE_ELEMS) * 2;
constexpr int COMBINE_BYTES = (WARPS * 16 * OBUF_STRIDE + 4 * WARPS * 16 + 64) * 4;
// PKV_TMA: 1024 bytes more, so the kernel can align the pipeline to the 1024-byte period of
// the 128-byte TMA swizzle.
// The pool's ring of claimed stages (decode_item) sits right after the pipeline, in the dynamic
// shared memory: static shared memory would sit before it and shift the pipeline's base.
constexpr int POOL_RING = 8;
constexpr int RING_BYTES = (PKV_POOL && !PKV_RING_STATIC) ? POOL_RING * 4 : 0;
constexpr int SMEM_BYTES = (PIPE_BYTES + RING_BYTES > COMBINE_BYTES ? PIPE_BYTES + RING_BYTES : COMBINE_BYTES) +
                           (PKV_TMA ? 1024 : 0);
#if PKV_TMA
static_assert(D == 128, "PKV_TMA: head_dim 128 only (two 64-element boxes per token row)");
static_assert(PKV_HEADSPLIT == 1, "PKV_TMA boxes address the real kv head; PKV_HEADSPLIT needs cp.async");
#endif
static_assert(PKV_HEADSPLIT >= 1 && PKV_HEADSPLIT <= 16, "PKV_HEADSPLIT: 1..16 virtual kv heads per kv head");
// Cluster route: each CTA publishes its normalised state, o [16][D] and lse [16] (fp32, rows >= G
// unused), in its own shared memory past the combine buffers, so the combine's last reads and the
// publication never overlap; the cluster's CTAs read it through distributed shared memory.
constexpr int PUB_OFFSET = (COMBINE_BYTES + 15) / 16 * 16;
constexpr int PUB_BYTES = (16 * D + 16) * 4;
static_assert(PUB_OFFSET + PUB_BYTES <= SMEM_BYTES, "cluster publication region must fit in SMEM_BYTES");
constexpr int MAX_CLUSTER = 16;  // CTAs per cluster; 16 is non-portable (8 is the portable limit)
// decode_item: a group of this many splits or more loads no item of 2..STAGES-1 tiles early.
constexpr int EARLY_SKIP_SPLITS = 8;

// Tail of decode_item: write a partial state (or the output when the item is its row's only
// split); the same, then the last CTA of the group merges through global memory; or publish the
// state in shared memory and merge inside the thread-block cluster.
enum Mode { PARTIAL = 0, FUSED = 1, CLUSTER = 2 };

// -inf as a bit pattern (no <math.h> under NVRTC).
#define NEG_INF __int_as_float(0xff800000)

struct Item {
  int row, head, lo, hi, split, nsplit, page_base, pool_lo, pool_hi;
};

// Items are 8 ints: (row | head << 16, lo, hi, split | nsplit << 16, page_base, pool_lo, pool_hi, 0);
// pool_hi > pool_lo: tokens [pool_lo, pool_hi) of the row are its (row, kv head)'s pool, claimed a
// stage at a time by the group's CTAs (fused work queue; plan.pooled_items). Loaded by volatile asm,
// which the compiler keeps where it is written (PKV_ITEM_OR_RETURN).
__device__ __forceinline__ Item load_item(const int4* __restrict__ items, int slot) {
  int4 a, b;
  asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(items + 2 * slot));
  asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(items + 2 * slot + 1));
  Item it;
  it.row = a.x & 0xFFFF;
  it.head = (unsigned)a.x >> 16;
  it.lo = a.y;
  it.hi = a.z;
  it.split = a.w & 0xFFFF;
  it.nsplit = a.w >> 16;  // arithmetic shift: a garbage word past the count may read negative
  it.page_base = b.x;
  it.pool_lo = b.y;
  it.pool_hi = b.z;
  return it;
}
// Q by volatile asm loads (the compiler keeps them after griddepcontrol.wait, where they are
// written; __ldg is an invariant load, which it may move above it, and the kernel before may be
// writing Q). The SASS is the same as with __ldg.
__device__ __forceinline__ uint4 ld_nc_v4(const kv_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned ld_nc_u32(const kv_t* p) {
  unsigned v;
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// A relaxed atomic add whose result is waited for only where it is used: written as PTX so that
// the compiler does not aggregate it across the warp (its aggregation broadcasts the result with a
// shuffle right after the atomic, which stalls the warp for the round trip).
__device__ __forceinline__ int atom_add_relaxed(int* p, int v) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v));
  return old;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes: masked tokens read as zeros, never as stale data.
  const int bytes = valid ? 16 : 0;
#if PKV_L2HINT == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#elif PKV_L2HINT == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if PKV_BF16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if PKV_BF16
  kv2_t v = __floats2bfloat162_rn(lo, hi);
#else
  kv2_t v = __floats2half2_rn(lo, hi);
#endif
  return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ kv_t to_kv(float x) {
#if PKV_BF16
  return __float2bfloat16_rn(x);
#else
  return __float2half_rn(x);
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (sm_90+; no-ops before, and when the launch did not ask for it).
// grid_wait: block until the grids this one depends on have completed and their memory is
// visible. grid_launch_dependents: let the next grid's CTAs be scheduled (they run up to their
// own grid_wait). Each CTA signals only after its own wait, so when a dependent CTA runs, every
// CTA of this grid has passed its wait: every grid before this one has completed.
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Swizzled element offset of (token row t, 16-byte chunk c) inside one stage of K or V.
__device__ __forceinline__ int swz(int t, int c) { return t * D + ((c ^ (t & 7)) << 3); }
// The same for stages filled by TMA with the 128-byte swizzle: a stage is two halves of D (64
// elements, 128 bytes per token row), each TILE rows; 16-byte chunk c8 of row t sits at c8 ^ (t & 7),
// which is what the hardware writes when each half starts at a multiple of 1024 bytes.
__device__ __forceinline__ int swz_tma(int t, int c) {
  return (c >> 3) * (TILE * 64) + t * 64 + (((c & 7) ^ (t & 7)) << 3);
}

#if PKV_TMA
// A CUtensorMap (cuda.h) by value: 128 opaque bytes, 128-byte aligned (as cuda.h 13 declares it).
struct __align__(128) TMap {
  unsigned long long v[16];
};
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
      ::"r"(bar), "r"(parity) : "memory");
}
// One box of the 4-d map (D, Hkv, page_size, pages) at (c0, c1, c2, c3) into shared memory at dst,
// completing on the mbarrier at bar.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const void* map, int c0, int c1, int c2, int c3,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

// PKV_TRACE: thread 0 stamps %globaltimer (ns, one clock for the whole GPU) and clock64 (this SM's
// cycles) at each phase of a CTA into shared memory (no registers held across the loop), and the
// kernel appends the record to pkv_trace at its end. Phases: 0 entry, 1 after grid_wait, 2 first
// stage landed, 3 loop done, 4 state written, 5 merge decided, 6 exit.
#if PKV_TRACE
constexpr int TRACE_STAMPS = 7;
constexpr int TRACE_FIELDS = 16;  // 7 ns stamps, 7 cycle stamps, 2 words of meta
constexpr int TRACE_RECORDS = 1 << 16;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* trace_slots() {
  __shared__ unsigned long long s_trace[TRACE_FIELDS];
  return s_trace;
}
__device__ __forceinline__ void stamp(int phase) {
  if (threadIdx.x == 0) {
    unsigned long long* t = trace_slots();
    t[phase] = global_ns();
    t[TRACE_STAMPS + phase] = clock64();
  }
}
#else
__device__ __forceinline__ void stamp(int) {}
#endif
// Stamps of one trace mode only (PKV_TRACE 1: phases 4 and 5 after the combine; 2: inside it).
__device__ __forceinline__ void stamp_if(int mode, int phase) {
  if (PKV_TRACE == mode) stamp(phase);
}

struct Params {
  const kv_t* q;         // [B, Hq, D] with strides q_sb, q_sh (elements)
  const kv_t* k;         // [pages, P, Hkv, D]: page stride kv_sp, token stride kv_st, head stride D
  const kv_t* v;
  kv_t* out;             // [B, Hq, D] with strides o_sb, o_sh
  const int* kv_indices; // CSR page ids; a row's pages start at item.page_base
  const int4* items;     // [n, 2] int4 (8 ints per item)
  const int* num_items;  // device item count (GPU-planned launches) or nullptr
  float* part_o;         // [slots, G, D]
  float* part_lse;       // [slots, G], log2 units
  int* counters;         // [B * Hkv][2], zero between launches: the fused merge's arrivals, the pool's cursor
  int slot_offset;       // slot of this launch's first item
  int num_kv_heads, group_size, log2_page;
  long long kv_sp, kv_st;
  long long q_sb, q_sh, o_sb, o_sh;
  float scale_log2;      // softmax scale * log2(e)
  int early;             // bit 0: read the item and page ids before the preceding grid completes (PDL);
                         // bit 1 (with bit 0): also the first stages' K/V of all but the item's last page
  const void* tmk;       // PKV_TMA: the K and V tensor maps (kernel parameters), else nullptr
  const void* tmv;
};

// One split's share of a merge: acc += w * o, den += w.
__device__ __forceinline__ void fold(float4& acc, float& den, float w, const float4& o) {
  den += w;
  acc.x += w * o.x;
  acc.y += w * o.y;
  acc.z += w * o.z;
  acc.w += w * o.w;
}

// A merged float4 of query head qh (of the row): out = acc / den, 0 when every split was empty.
__device__ __forceinline__ void write_merged(const Params& p, int row, int qh, int d, const float4& acc, float den) {
  const float inv = den > 0.f ? 1.f / den : 0.f;
  kv_t* dst = p.out + row * p.o_sb + (long long)qh * p.o_sh + d;
  dst[0] = to_kv(acc.x * inv);
  dst[1] = to_kv(acc.y * inv);
  dst[2] = to_kv(acc.z * inv);
  dst[3] = to_kv(acc.w * inv);
}

// Merge the partial states of one (row, kv head): slots [base, base + n).
// Each thread owns one float4 of one query head's output and walks the n partial states in
// chunks of MERGE_UNROLL, loading a chunk's lse values and o columns together (all in flight)
// and folding them in with an online softmax over splits: no shared memory, no barrier, about
// n / MERGE_UNROLL L2 round trips. Threads of a warp share g, so their lse loads coalesce.
constexpr int MERGE_UNROLL = 16;
__device__ void merge_group(const Params& p, int row, int head, int base, int n) {
  const int G = p.group_size;
  constexpr int D4 = D / 4;
  const float* lse = p.part_lse + (long long)base * G;
  for (int idx = threadIdx.x; idx < G * D4; idx += THREADS) {
    const int g = idx / D4, d = (idx - g * D4) * 4;
    const float* col = p.part_o + ((long long)base * G + g) * D + d;
    float m = NEG_INF, den = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < n; s0 += MERGE_UNROLL) {
      float l[MERGE_UNROLL];
      float4 o[MERGE_UNROLL];
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; ++u) {
        const bool ok = s0 + u < n;
        l[u] = ok ? __ldcg(lse + (s0 + u) * G + g) : NEG_INF;
        o[u] = ok ? __ldcg(reinterpret_cast<const float4*>(col + (long long)(s0 + u) * G * D))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float mc = m;
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; ++u) mc = fmaxf(mc, l[u]);
      if (mc == NEG_INF) continue;  // every split so far is empty
      const float scale = fast_exp2(m - mc);  // m = -inf -> 0
      den *= scale;
      acc.x *= scale;
      acc.y *= scale;
      acc.z *= scale;
      acc.w *= scale;
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; ++u) {
        fold(acc, den, fast_exp2(l[u] - mc), o[u]);  // empty split: lse = -inf -> weight 0
      }
      m = mc;
    }
    write_merged(p, row, head * G + g, d, acc, den);
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Thread-block cluster primitives (sm_90+): a full cluster barrier whose arrive releases and whose
// wait acquires this CTA's shared-memory writes, the address of the same variable in CTA `rank`'s
// shared memory, and loads through distributed shared memory.
// The non-.aligned forms of the cluster barrier: the .aligned ones require every thread of a warp
// to execute them convergently, and the merge loop before the second barrier (and the tails
// before the first) leave lanes diverged (compute-sanitizer's synccheck flagged "divergent
// threads in warp" at this barrier with the .aligned forms, also after a __syncwarp()).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_map(unsigned addr, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
__device__ __forceinline__ float ld_cluster(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cluster4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}

// Merge inside a cluster of C CTAs, the C splits of one (row, kv head): every CTA has published
// its (o, lse) at pub_o / pub_lse in its own shared memory. After a cluster barrier, CTA `rank`
// merges its 1/C of the G x D/4 output float4s, each thread loading all C states of its float4
// at once (C round trips in flight, no global memory), with merge_group's math. A second barrier
// keeps every CTA's shared memory alive until the others have read it.
template <int C>
__device__ __forceinline__ void cluster_merge(const Params& p, int row, int head, int rank, const float* pub_o,
                                              const float* pub_lse) {
  cluster_sync();
  const int G = p.group_size;
  constexpr int D4 = D / 4;
  const int total = G * D4, per = (total + C - 1) / C;
  const int start = rank * per, stop = min(total, start + per);
  const unsigned o_local = smem_u32(pub_o), lse_local = smem_u32(pub_lse);
  for (int idx = start + (int)threadIdx.x; idx < stop; idx += THREADS) {
    const int g = idx / D4, d = (idx - g * D4) * 4;
    float l[C];
    float4 o[C];
#pragma unroll
    for (int s = 0; s < C; ++s) {
      l[s] = ld_cluster(cluster_map(lse_local + g * 4, s));
      o[s] = ld_cluster4(cluster_map(o_local + (g * D + d) * 4, s));
    }
    float M = NEG_INF;
#pragma unroll
    for (int s = 0; s < C; ++s) M = fmaxf(M, l[s]);
    float den = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (M != NEG_INF) {
#pragma unroll
      for (int s = 0; s < C; ++s) {
        fold(acc, den, fast_exp2(l[s] - M), o[s]);  // empty split: lse = -inf -> weight 0
      }
    }
    write_merged(p, row, head * G + g, d, acc, den);
  }
  cluster_sync();
}
#endif

// One item's partial state, then MODE's tail. C: CTAs per cluster (MODE == CLUSTER only).
template <int MODE, int C = 1>
__device__ void decode_item(const Params& p, int slot, const Item& it, kv_t* smem) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = p.group_size;
  const int P_mask = (1 << p.log2_page) - 1;
  const int row = it.row, head = it.head, lo = it.lo, hi = it.hi;

  kv_t* sQ = smem;
  kv_t* sK = smem + Q_ELEMS;
  kv_t* sV = sK + STAGES * STAGE_ELEMS;
  const kv_t* kbase = p.k + (long long)(head / PKV_HEADSPLIT) * D;
  const kv_t* vbase = p.v + (long long)(head / PKV_HEADSPLIT) * D;
  const int* pages = p.kv_indices + it.page_base;

  // PKV_TMA (decode launches; the cluster route keeps cp.async): warp 0 loads each tile with one
  // TMA box per lane, a (16-token slice of one page, half of D, K or V) box of 2 KB landing
  // swizzled (swz_tma), all of a stage completing on its mbarrier. The boxes read whole 16-token
  // slices, so a tile's V rows past hi (and rows of slices past hi, not loaded) are zeroed after
  // it lands: masked scores weigh them 0, and 0 x stale bits could be NaN.
  constexpr bool TMA = PKV_TMA && MODE != CLUSTER;
  auto SW = [](int t, int c) { return TMA ? swz_tma(t, c) : swz(t, c); };
#if PKV_TMA
  __shared__ __align__(8) unsigned long long tma_bar[STAGES];
  constexpr int TMA_SLICES = TILE / 16;
  constexpr int TMA_OPS = TMA_SLICES * 4;
  static_assert(TMA_OPS <= 32, "one TMA box per lane of warp 0");
  const int op_i = lane >> 2, op_h = (lane >> 1) & 1, op_v = lane & 1;
  auto tma_page = [&](int tile) -> int {
    const int tok = lo + tile * TILE + op_i * 16;
    return lane < TMA_OPS && tok < hi ? __ldg(pages + (tok >> p.log2_page)) : -1;
  };
  auto tma_issue = [&](int tile, int pg) {  // warp 0
    const int stage = tile % STAGES;
    const int t0 = lo + tile * TILE;
    const int slices = min(TMA_SLICES, (hi - t0 + 15) >> 4);
    const unsigned bar = smem_u32(&tma_bar[stage]);
    if (lane == 0) mbar_expect_tx(bar, slices * 4 * 16 * 128);
    __syncwarp();
    if (pg >= 0) {
      fence_proxy_async();  // this stage's earlier generic reads before the async refill
      const kv_t* st = (op_v ? sV : sK) + stage * STAGE_ELEMS + op_h * (TILE * 64) + op_i * 16 * 64;
      tma_load_4d(smem_u32(st), op_v ? p.tmv : p.tmk, op_h * 64, head, (t0 + op_i * 16) & P_mask, pg, bar);
    }
  };
  int tpg[STAGES - 1], tpg_next = -1;
  if constexpr (TMA) {
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&tma_bar[s]), 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (warp == 0) {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) tpg[s] = tma_page(s);
      tpg_next = tma_page(STAGES - 1);
    }
    __syncthreads();
  }
#endif

  // This thread's load slots: chunk c of token rows r0 + ROWS_PER_PASS * i.
  const int lc = tid % CHUNKS;
  const int lr = tid / CHUNKS;

  // Tiles: the item's own ntiles stages of [lo, hi), then (pooled) stages of the group's pool
  // [pool_lo, pool_hi) that this CTA claimed: their first tokens wait in pool_ring (claim k at
  // k % POOL_RING), -1 once the pool is spent. Claims run ahead of the loads (see the loop), and a
  // ring entry is written at least one barrier before its first read and outlives its tile's use.
  const int ntiles = hi > lo ? (hi - lo + TILE - 1) / TILE : 0;
  const bool pooled = PKV_POOL && MODE == FUSED && !TMA && it.pool_hi > it.pool_lo && it.nsplit > 1;
  static_assert(POOL_RING >= STAGES + 2 && (POOL_RING & (POOL_RING - 1)) == 0, "pool ring: a power of two >= STAGES + 2");
#if PKV_RING_STATIC
  __shared__ int pool_ring[POOL_RING];
#else
  int* pool_ring = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(smem) + PIPE_BYTES);
#endif
  auto tile_lo = [&](int u) { return !PKV_POOL || u < ntiles ? lo + u * TILE : pool_ring[(u - ntiles) & (POOL_RING - 1)]; };
  auto tile_hi = [&](int u) { return !PKV_POOL || u < ntiles ? hi : it.pool_hi; };
  auto has_tile = [&](int u) { return u < ntiles || (pooled && pool_ring[(u - ntiles) & (POOL_RING - 1)] >= 0); };

  auto fetch_pages = [&](int tile, int (&pg)[LOADS]) {
    const int t0 = tile_lo(tile), t1 = tile_hi(tile);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int tok = t0 + lr + ROWS_PER_PASS * i;
      pg[i] = tok < t1 ? __ldg(pages + (tok >> p.log2_page)) : 0;
    }
  };
  // part 0: the tile's loads; early K/V loads (p.early bit 1) split them in two: part 1 every page
  // but the item's last (and the zero fill past hi), part 2 the item's last page.
  const int last_page = (hi - 1) >> p.log2_page;
  // Early K/V loads, but not for an item of 2..STAGES-1 tiles in a group of EARLY_SKIP_SPLITS or
  // more splits: there the early loads cover the whole item, all CTAs' at once, while the
  // previous call's merges (as many states each) still run, and that call ends later by more
  // than the loads gain (B=1 x 4K: 10.5 -> 9.8 us without them; benchmarks/NOTES.md).
  const bool early_kv = !TMA && (p.early & 2) &&
                        !(ntiles > 1 && ntiles <= STAGES - 1 && it.nsplit >= EARLY_SKIP_SPLITS);
  // With early_kv: whether tile s (< STAGES - 1) is loaded early (PKV_EARLY_STAGES: the first ones only).
  auto early_stage = [&](int s) { return s < ntiles && (PKV_EARLY_STAGES == 0 || s < PKV_EARLY_STAGES); };
  // A token row's byte offset from its page id: one 32 x 32 -> 64-bit multiply-add (IMAD.WIDE.U32)
  // of the byte strides, which DecodeEngine keeps below 4 GB (a page, and a row's offset in it).
  // The 64-bit math of v16 took ~20 instructions per K/V load pair, issued in the loop's critical
  // section between a tile's landing and the next tile's loads (benchmarks/NOTES.md v17).
  const unsigned sp_b = (unsigned)p.kv_sp * 2u, st_b = (unsigned)p.kv_st * 2u;
  const char* kbytes = reinterpret_cast<const char*>(kbase);
  const char* vbytes = reinterpret_cast<const char*>(vbase);
  auto issue = [&](int tile, const int (&pg)[LOADS], int part) {
    const unsigned dK = smem_u32(sK + (tile % STAGES) * STAGE_ELEMS);
    const unsigned dV = smem_u32(sV + (tile % STAGES) * STAGE_ELEMS);
    const int t0 = tile_lo(tile), t1 = tile_hi(tile);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int t = lr + ROWS_PER_PASS * i;
      const int tok = t0 + t;
      const bool valid = tok < t1;
      if (part != 0 && (part == 2) != (valid && (tok >> p.log2_page) == last_page)) continue;
      const unsigned so = swz(t, lc) * 2;
      // past hi: page id 0 (fetch_pages) and an in-page offset, an address of the cache that
      // src-size 0 never reads
      const unsigned long long off =
          (unsigned long long)(unsigned)pg[i] * sp_b + ((unsigned)(tok & P_mask) * st_b + lc * 16u);
      cp_async16(dK + so, kbytes + off, valid);
      cp_async16(dV + so, vbytes + off, valid);
    }
  };

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

  // Prologue: page ids for the first STAGES tiles (independent loads, issued together). Under
  // programmatic dependent launch with p.early set, they (and the item) are read before
  // grid_wait, while the preceding kernel still runs. Then Q, and the K/V loads of the first
  // STAGES - 1 tiles; tile STAGES - 1's ids wait in pg_next. (An L2 prefetch of those K/V tiles
  // before the wait was measured too, commit 24023d6: no faster anywhere, up to 0.6 us slower.)
  // With p.early bit 1 (DecodeEngine early_kv), their loads into shared memory are issued before
  // the wait too, but for the item's last page: the page that a decode step's append, the kernel
  // before this one, may be writing.
  int pg_next[LOADS];  // the page ids of the next tile to load: t + STAGES - 1 at iteration t
  int pg[STAGES - 1][LOADS];
  if constexpr (!TMA) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < ntiles) fetch_pages(s, pg[s]);
    if (STAGES - 1 < ntiles) fetch_pages(STAGES - 1, pg_next);
    // Early K/V: uncommitted until the first commit below, so they join tile 0's group (waiting
    // for a tile still waits for all of its loads).
    if (early_kv) {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s)
        if (early_stage(s)) issue(s, pg[s], 1);
    }
  }
  grid_wait();               // Q, K/V, partial states and counters may be the preceding kernel's
  grid_launch_dependents();
  stamp(1);

  // Pool claims (thread 0; after the wait: the preceding launch of this plan resets the cursor).
  // Tile u's claim is in flight one iteration and written to the ring at the end of iteration
  // u - STAGES - 1, so the barrier of the next iteration publishes it before its page ids are
  // fetched. Tiles u <= STAGES of the pool are claimed here at once, the ring published by a barrier.
  int* cursor = p.counters + 2 * (row * p.num_kv_heads + head) + 1;
  int claim = 0;
  bool pool_done = !pooled;  // thread 0's view: no claim in flight or to come
  if (pooled && !PKV_POOL_NOPROLOGUE) {
    if (tid == 0) {
      const int m = STAGES + 1 - ntiles;
      if (m > 0) {
        const int j0 = atom_add_relaxed(cursor, m);
        for (int r = 0; r < m; ++r) {
          int b = it.pool_lo + (j0 + r) * TILE;
          if (pool_done || b >= it.pool_hi) b = -1, pool_done = true;
          pool_ring[r] = b;
        }
      }
      if (!pool_done && STAGES + 1 >= ntiles) claim = atom_add_relaxed(cursor, 1);
    }
    if (ntiles <= STAGES) {  // uniform: the first pool tiles' page ids are fetched here
      __syncthreads();
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s)
        if (s >= ntiles && has_tile(s)) fetch_pages(s, pg[s]);
      if (STAGES - 1 >= ntiles && has_tile(STAGES - 1)) fetch_pages(STAGES - 1, pg_next);
    }
  }

  // Q fragments (A operand, 16 rows = query heads of this kv head, zero beyond G).
  unsigned qf[Q_SMEM ? 1 : D / 16][4];
  if constexpr (Q_SMEM) {
    for (int idx = tid; idx < 16 * CHUNKS; idx += THREADS) {
      const int g = idx / CHUNKS, c = idx - g * CHUNKS;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (g < G) val = ld_nc_v4(p.q + row * p.q_sb + (long long)(head * G + g) * p.q_sh + c * 8);
      *reinterpret_cast<uint4*>(sQ + swz(g, c)) = val;  // visible after the loop's first barrier
    }
  } else {
    const int g0 = lane >> 2, g1 = g0 + 8, c = (lane & 3) * 2;
    const kv_t* q0 = p.q + row * p.q_sb + (long long)(head * G + g0) * p.q_sh;
    const kv_t* q1 = p.q + row * p.q_sb + (long long)(head * G + g1) * p.q_sh;
#pragma unroll
    for (int kk = 0; kk < (Q_SMEM ? 1 : D / 16); ++kk) {
      qf[kk][0] = g0 < G ? ld_nc_u32(q0 + kk * 16 + c) : 0u;
      qf[kk][1] = g1 < G ? ld_nc_u32(q1 + kk * 16 + c) : 0u;
      qf[kk][2] = g0 < G ? ld_nc_u32(q0 + kk * 16 + 8 + c) : 0u;
      qf[kk][3] = g1 < G ? ld_nc_u32(q1 + kk * 16 + 8 + c) : 0u;
    }
  }
#if PKV_TMA
  if constexpr (TMA) {
    if (warp == 0) {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s)
        if (s < ntiles) tma_issue(s, tpg[s]);
    }
  } else
#endif
  {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {  // one commit group per tile
      const int part = early_kv && early_stage(s) ? 2 : 0;
      if (has_tile(s)) issue(s, pg[s], part);
      cp_async_commit();
    }
  }

  // Whether tile t + STAGES - 1 exists and its page ids are in pg_next. Ring entries past the
  // pool's end (-1) are never written, so the look-ahead stops at the first missing tile rather
  // than asking has_tile of a later one, whose ring slot may hold an older claim.
  bool ahead = has_tile(STAGES - 1);
  for (int t = 0; has_tile(t); ++t) {
#if PKV_TMA
    if constexpr (TMA) {
      const int stage = t % STAGES;
      mbar_wait(smem_u32(&tma_bar[stage]), (t / STAGES) & 1);
      const int first = hi - (lo + t * TILE);  // >= 1
      if (first < TILE) {
        kv_t* v_st = sV + stage * STAGE_ELEMS;
        for (int idx = tid; idx < (TILE - first) * CHUNKS; idx += THREADS) {
          const int r = first + idx / CHUNKS, c = idx % CHUNKS;
          *reinterpret_cast<uint4*>(v_st + swz_tma(r, c)) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      __syncthreads();  // tile t landed (and its tail zeroed); stage (t-1) % STAGES is free again
      if (PKV_TRACE && t == 0) stamp(2);
      if (warp == 0) {
        const int nt = t + STAGES - 1;
        if (nt < ntiles) {
          tma_issue(nt, tpg_next);
          if (nt + 1 < ntiles) tpg_next = tma_page(nt + 1);
        }
      }
    } else
#endif
    {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile t landed for every thread; tile t - 1's stages are free again
      if (PKV_TRACE && t == 0) stamp(2);
      if (ahead) {
        issue(t + STAGES - 1, pg_next, 0);
        ahead = has_tile(t + STAGES);
        if (ahead) fetch_pages(t + STAGES, pg_next);  // used one iteration later
      }
      cp_async_commit();
    }
    const int t_hi = tile_hi(t);
    const int tok0 = tile_lo(t) + warp * 16;
    if (tok0 < t_hi) {  // warp-uniform: skip warps whose 16 tokens all lie past the tile's bound
      const kv_t* k_st = sK + (t % STAGES) * STAGE_ELEMS;
      const kv_t* v_st = sV + (t % STAGES) * STAGE_ELEMS;
      float s[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int tk = warp * 16 + (mi >> 1) * 8 + r;
        unsigned b0, b1, b2, b3;
        ldsm_x4(smem_u32(k_st + SW(tk, 2 * kk + (mi & 1))), b0, b1, b2, b3);
        if constexpr (Q_SMEM) {
          unsigned a[4];
          ldsm_x4(smem_u32(sQ + swz((mi & 1) * 8 + r, 2 * kk + (mi >> 1))), a[0], a[1], a[2], a[3]);
          mma16816(s[0], a, b0, b1);
          mma16816(s[1], a, b2, b3);
        } else {
          mma16816(s[0], qf[kk], b0, b1);
          mma16816(s[1], qf[kk], b2, b3);
        }
      }
      // Mask, scale to base 2, online softmax (rows g = lane/4 and g + 8).
      float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
          s[j][e] = tok < t_hi ? s[j][e] * p.scale_log2 : NEG_INF;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float base0 = mn0 == NEG_INF ? 0.f : mn0, base1 = mn1 == NEG_INF ? 0.f : mn1;
      const float a0 = fast_exp2(m0 - base0), a1 = fast_exp2(m1 - base1);
      m0 = mn0;
      m1 = mn1;
      float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s[j][0] = fast_exp2(s[j][0] - base0);
        s[j][1] = fast_exp2(s[j][1] - base0);
        s[j][2] = fast_exp2(s[j][2] - base1);
        s[j][3] = fast_exp2(s[j][3] - base1);
        ps0 += s[j][0] + s[j][1];
        ps1 += s[j][2] + s[j][3];
      }
      l0 = l0 * a0 + ps0;
      l1 = l1 * a1 + ps1;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] *= a0;
        o[j][1] *= a0;
        o[j][2] *= a1;
        o[j][3] *= a1;
      }
      unsigned pa[4];
      pa[0] = pack2(s[0][0], s[0][1]);
      pa[1] = pack2(s[0][2], s[0][3]);
      pa[2] = pack2(s[1][0], s[1][1]);
      pa[3] = pack2(s[1][2], s[1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int tv = warp * 16 + (mi & 1) * 8 + r;
        unsigned b0, b1, b2, b3;
        ldsm_x4_t(smem_u32(v_st + SW(tv, 2 * dp + (mi >> 1))), b0, b1, b2, b3);
        mma16816(o[2 * dp], pa, b0, b1);
        mma16816(o[2 * dp + 1], pa, b2, b3);
      }
    }
    if (!PKV_POOL_NOCLAIM && tid == 0 && !pool_done) {  // the claim in flight is tile t + STAGES + 1's; claim the next
      const int u = t + STAGES + 1;
      if (u >= ntiles) {
        int b = it.pool_lo + claim * TILE;
        if (b >= it.pool_hi) b = -1, pool_done = true;
        pool_ring[(u - ntiles) & (POOL_RING - 1)] = b;
      }
      if (!pool_done && u + 1 >= ntiles) claim = atom_add_relaxed(cursor, 1);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the combine buffers
  stamp(3);

  const bool direct = MODE != CLUSTER && it.nsplit <= 1;
  // Combine the WARPS warps' (m, l, O) through shared memory.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  float* obuf = reinterpret_cast<float*>(smem);            // [WARPS][16][OBUF_STRIDE]
  float* redM = obuf + WARPS * 16 * OBUF_STRIDE;            // [WARPS][16]
  float* redL = redM + WARPS * 16;                          // [WARPS][16]
  int* flag = reinterpret_cast<int*>(redL + WARPS * 16);
  const int g0 = lane >> 2, g1 = g0 + 8;
  if ((lane & 3) == 0) {
    redM[warp * 16 + g0] = m0;
    redL[warp * 16 + g0] = l0;
    redM[warp * 16 + g1] = m1;
    redL[warp * 16 + g1] = l1;
  }
  {  // each warp's O as it stands, relative to its own row maxima; weighed below, where summed
    const int c = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (g0 < G) *reinterpret_cast<float2*>(obuf + (warp * 16 + g0) * OBUF_STRIDE + j * 8 + c) = make_float2(o[j][0], o[j][1]);
      if (g1 < G) *reinterpret_cast<float2*>(obuf + (warp * 16 + g1) * OBUF_STRIDE + j * 8 + c) = make_float2(o[j][2], o[j][3]);
    }
  }
  __syncthreads();
  stamp_if(2, 4);
  stamp_if(2, 5);

  float* pub_o = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(smem) + PUB_OFFSET);  // [16][D]
  float* pub_lse = pub_o + 16 * D;                                                                // [16]
  // Two adjacent dims per thread; each thread derives its row's (M, L) from the WARPS warps'
  // (m, l) itself (broadcast reads) and weighs warp w's O by 2^(m_w - M), so one barrier suffices
  // (the combine of v9-v15 scaled O before a second barrier: 1-2 % slower below ~16K tokens).
  constexpr int D2 = D / 2;
  for (int idx = tid; idx < G * D2; idx += THREADS) {
    const int g = idx / D2, d = (idx - g * D2) * 2;
    float M = NEG_INF, L = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, redM[w * 16 + g]);
    float2 acc = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float2 v = *reinterpret_cast<const float2*>(obuf + (w * 16 + g) * OBUF_STRIDE + d);
      const float e = M != NEG_INF ? fast_exp2(redM[w * 16 + g] - M) : 0.f;  // an empty warp: O = 0, l = 0
      acc.x += v.x * e;
      acc.y += v.y * e;
      L += redL[w * 16 + g] * e;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const float2 val = make_float2(acc.x * inv, acc.y * inv);
    const float lse = L > 0.f ? M + __log2f(L) : NEG_INF;  // an empty state: o = 0, lse = -inf
    if (MODE == CLUSTER) {
      *reinterpret_cast<float2*>(pub_o + g * D + d) = val;
      if (d == 0) pub_lse[g] = lse;
    } else if (direct) {
      kv_t* dst = p.out + row * p.o_sb + (long long)(head * G + g) * p.o_sh + d;
      dst[0] = to_kv(val.x);
      dst[1] = to_kv(val.y);
    } else {
      *reinterpret_cast<float2*>(p.part_o + ((long long)slot * G + g) * D + d) = val;
      if (d == 0) p.part_lse[(long long)slot * G + g] = lse;
    }
  }
  stamp_if(1, 4);
  if constexpr (MODE == CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_merge<C>(p, row, head, it.split, pub_o, pub_lse);
#endif
    return;
  }
  if (MODE != FUSED || direct) return;

  // Fused merge: the last CTA of this (row, kv head) to finish merges its group. After the
  // barrier, one thread's acq_rel atomic publishes the whole CTA's partial state (release is
  // cumulative over what the barrier ordered before it) and, for the last CTA, acquires the
  // others'; the barrier after it extends that to every thread, whose loads then go to L2 (.cg).
  // (An election at the loop's end instead, the combine overlapping the atomic and the others
  // publishing with a release increment the last one waits for, was measured too: no faster,
  // benchmarks/NOTES.md v9.)
  __syncthreads();
  if (tid == 0) {
    int* counter = p.counters + 2 * (row * p.num_kv_heads + head);
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counter) : "memory");
    const int last = prev == it.nsplit - 1;
    if (last) {  // ready for the next launch; nobody else touches them in this one (every CTA's
      counter[0] = 0;  // claims returned before it arrived)
      if (pooled) counter[1] = 0;
    }
    *flag = last;
  }
  __syncthreads();
  stamp_if(1, 5);
#if PKV_TRACE
  if (tid == 0) trace_slots()[2 * TRACE_STAMPS + 1] = *flag;
#endif
  if (!*flag) return;
  merge_group(p, row, head, slot - it.split, it.nsplit);
}

}  // namespace pkv

using pkv::Params;

// Launch facts the host reads from the module (never restated in Python): dynamic shared
// memory per decode CTA, threads per CTA, tokens per pipeline stage, pipeline stages (of K and of
// V each), planner tile.
extern "C" __device__ const int pkv_config[5] = {pkv::SMEM_BYTES, pkv::THREADS, pkv::TILE, pkv::STAGES, 32};

#if PKV_TRACE
// Records of PKV_TRACE builds: TRACE_FIELDS words each, appended in the order CTAs finish.
extern "C" {
__device__ unsigned long long pkv_trace[pkv::TRACE_RECORDS * pkv::TRACE_FIELDS];
__device__ unsigned int pkv_trace_count;
}
namespace pkv {
// The end of a traced CTA: stamp the exit, then thread 0 appends the record (meta word 0: SM,
// block, item slot; word 1: merged or not, set by the fused tail).
__device__ __forceinline__ void trace_end(int slot, const Item& it) {
  stamp(6);
  if (threadIdx.x == 0) {
    unsigned long long* t = trace_slots();
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    t[2 * TRACE_STAMPS] = (unsigned long long)smid | ((unsigned long long)blockIdx.x << 16) |
                          ((unsigned long long)(unsigned)slot << 40);
    t[2 * TRACE_STAMPS + 1] |= (unsigned long long)(it.hi - it.lo) << 8;
    const unsigned r = atomicAdd(&pkv_trace_count, 1u);
    if (r < TRACE_RECORDS)
      for (int f = 0; f < TRACE_FIELDS; ++f) pkv_trace[(unsigned long long)r * TRACE_FIELDS + f] = t[f];
  }
}
}  // namespace pkv
#define PKV_TRACE_BEGIN                                                               \
  if (threadIdx.x == 0)                                                               \
    for (int f = 0; f < pkv::TRACE_FIELDS; ++f) pkv::trace_slots()[f] = 0ull;         \
  pkv::stamp(0)
#define PKV_TRACE_END(slot, it) pkv::trace_end(slot, it)
#else
#define PKV_TRACE_BEGIN
#define PKV_TRACE_END(slot, it)
#endif

#if PKV_TMA
// The tensor maps of K and V (cuTensorMapEncodeTiled on the host, 128-byte swizzle), passed by
// value as grid constants: TMA reads them from parameter memory.
#define PKV_TMA_ARGS , const __grid_constant__ pkv::TMap tmk, const __grid_constant__ pkv::TMap tmv
#define PKV_TMA_FILL , &tmk, &tmv
// The pipeline starts at the next multiple of 1024 bytes (the swizzle's period); SMEM_BYTES has room.
#define PKV_SMEM_BASE(raw) (raw + ((1024u - (pkv::smem_u32(raw) & 1023u)) & 1023u))
#else
#define PKV_TMA_ARGS
#define PKV_TMA_FILL
#define PKV_SMEM_BASE(raw) (raw)
#endif

// This CTA's slot and item, or return when a GPU-planned launch has fewer items than CTAs. The
// item is loaded together with the count, not after it: its buffer holds every CTA's slot
// (max_items), and a CTA past the count leaves without using what it read. Loaded after the count,
// the item cost each GPU-planned CTA one more global round trip before its first page ids.
// The count is a volatile asm load (as __ldg, an invariant load to the compiler, it was hoisted
// above the kernel's griddepcontrol.wait), and the return tests words of the item as well (never
// negative in a real item: nsplit < 2^15, page_base >= 0), so that ptxas cannot sink the item's
// loads below it.
#define PKV_ITEM_OR_RETURN(slot, it)                                                   \
  const int slot = slot_offset + blockIdx.x;                                           \
  const int pkv_count = num_items != nullptr ? pkv::ld_volatile(num_items) : (int)gridDim.x; \
  const pkv::Item it = pkv::load_item(items, slot);                                   \
  if ((int)blockIdx.x >= pkv_count || it.nsplit < 0 || it.page_base < 0) return

#define PKV_DECODE_ARGS                                                                              \
  const kv_t *q, const kv_t *k, const kv_t *v, kv_t *out, const int *kv_indices, const int4 *items, \
      const int *num_items, float *part_o, float *part_lse, int *counters, int slot_offset,          \
      int num_kv_heads, int group_size, int log2_page, long long kv_sp, long long kv_st,            \
      long long q_sb, long long q_sh, long long o_sb, long long o_sh, float scale_log2, int early   \
      PKV_TMA_ARGS

#define PKV_FILL_PARAMS                                                                             \
  Params p{q, k, v, out, kv_indices, items, num_items, part_o, part_lse, counters, slot_offset,   \
           num_kv_heads, group_size, log2_page, kv_sp, kv_st, q_sb, q_sh, o_sb, o_sh, scale_log2, early \
           PKV_TMA_FILL}

// The work-queue kernels: pkv_decode writes partial states (a separate pkv_merge combines them),
// pkv_decode_fused merges in the last CTA of each group.
#define PKV_DECODE_KERNEL(NAME, MODE)                                                                  \
  extern "C" __global__ void __launch_bounds__(pkv::THREADS, pkv::MIN_BLOCKS) NAME(PKV_DECODE_ARGS) { \
    PKV_FILL_PARAMS;                                                                                 \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                        \
    PKV_TRACE_BEGIN;                                                                                 \
    if (!early) pkv::grid_wait(); /* the item and the GPU-planned count may be the preceding kernel's */ \
    PKV_ITEM_OR_RETURN(slot, it);                                                                    \
    pkv::decode_item<MODE>(p, slot, it, reinterpret_cast<kv_t*>(PKV_SMEM_BASE(smem_raw)));          \
    PKV_TRACE_END(slot, it);                                                                         \
  }
PKV_DECODE_KERNEL(pkv_decode, pkv::PARTIAL)
PKV_DECODE_KERNEL(pkv_decode_fused, pkv::FUSED)

// The cluster route: grid = B * Hkv * C CTAs, blockIdx.x = (row * Hkv + head) * C + rank, one
// thread-block cluster of C CTAs per (row, kv head). No items, counters or partial states in
// global memory: each CTA reads its row's length and page base and takes the stage-aligned range
//   n = ceil(T / TILE);  lo = min(T, n * rank / C * TILE);  hi = min(T, n * (rank + 1) / C * TILE)
// (TILE = 64 tokens at 4 warps, 128 at 8; plan.cluster_split_bounds with tile=TILE)
// (empty when lo >= hi), then the cluster merges its C states through distributed shared memory
// (cluster_merge). The grid depends only on B, so a captured graph stays valid when the lengths
// in seq_lens change on the device. C = 1 is no cluster: the CTA writes its row's output.
#define PKV_CLUSTER_ARGS                                                                               \
  const kv_t *q, const kv_t *k, const kv_t *v, kv_t *out, const int *kv_indices, const int *seq_lens, \
      const int *kv_indptr, int num_kv_heads, int group_size, int log2_page, long long kv_sp,          \
      long long kv_st, long long q_sb, long long q_sh, long long o_sb, long long o_sh, float scale_log2

namespace pkv {
template <int C>
__device__ __forceinline__ void decode_cluster(PKV_CLUSTER_ARGS) {
  static_assert(C >= 1 && C <= MAX_CLUSTER && (C & (C - 1)) == 0, "cluster size must be 1, 2, 4, 8 or 16");
  Params p{q, k, v, out, kv_indices, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
           num_kv_heads, group_size, log2_page, kv_sp, kv_st, q_sb, q_sh, o_sb, o_sh, scale_log2, 0};
  extern __shared__ __align__(16) unsigned char smem_raw[];
  grid_wait();  // a no-op unless launched with PDL (the engine does not): the lengths come first
  const int group = blockIdx.x / C, rank = blockIdx.x - group * C;
  Item it;
  it.row = group / num_kv_heads;
  it.head = group - it.row * num_kv_heads;
  const int T = __ldg(seq_lens + it.row);  // these two loads and Q's are in flight together
  it.page_base = __ldg(kv_indptr + it.row);
  const int tiles = (T + TILE - 1) / TILE;
  it.lo = min(T, tiles * rank / C * TILE);
  it.hi = min(T, tiles * (rank + 1) / C * TILE);
  it.split = rank;
  it.nsplit = C;
  it.pool_lo = it.pool_hi = 0;
  decode_item<C == 1 ? PARTIAL : CLUSTER, C>(p, 0, it, reinterpret_cast<kv_t*>(smem_raw));
}
}  // namespace pkv

#define PKV_CLUSTER_CALL \
  q, k, v, out, kv_indices, seq_lens, kv_indptr, num_kv_heads, group_size, log2_page, kv_sp, kv_st, q_sb, q_sh, o_sb, o_sh, scale_log2

extern "C" __global__ void __launch_bounds__(pkv::THREADS, pkv::MIN_BLOCKS) pkv_decode_cluster1(PKV_CLUSTER_ARGS) {
  pkv::decode_cluster<1>(PKV_CLUSTER_CALL);
}

// Clusters need sm_90: older targets (CI compiles sm_80) get kernels of the same names that trap;
// the engine refuses the route on such devices before any launch.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define PKV_CLUSTER_KERNEL(C)                                                        \
  extern "C" __global__ void __launch_bounds__(pkv::THREADS, pkv::MIN_BLOCKS)        \
      pkv_decode_cluster##C(PKV_CLUSTER_ARGS) {                                      \
    __trap();                                                                        \
  }
#else
#define PKV_CLUSTER_KERNEL(C)                                                        \
  extern "C" __global__ void __cluster_dims__(C, 1, 1)                               \
      __launch_bounds__(pkv::THREADS, pkv::MIN_BLOCKS) pkv_decode_cluster##C(PKV_CLUSTER_ARGS) { \
    pkv::decode_cluster<C>(PKV_CLUSTER_CALL);                                        \
  }
#endif
PKV_CLUSTER_KERNEL(2)
PKV_CLUSTER_KERNEL(4)
PKV_CLUSTER_KERNEL(8)
PKV_CLUSTER_KERNEL(16)  // non-portable: the engine sets NON_PORTABLE_CLUSTER_SIZE_ALLOWED

// One CTA per merge group: groups[i] = (row, kv head, first slot, num splits).
extern "C" __global__ void __launch_bounds__(pkv::THREADS) pkv_merge(
    const int4* groups, const float* part_o, const float* part_lse, kv_t* out, int group_size,
    long long o_sb, long long o_sh) {
  const int4 grp = groups[blockIdx.x];
  Params p{};
  p.part_o = const_cast<float*>(part_o);
  p.part_lse = const_cast<float*>(part_lse);
  p.out = out;
  p.group_size = group_size;
  p.o_sb = o_sb;
  p.o_sh = o_sh;
  pkv::merge_group(p, grp.x, grp.y, grp.z, grp.w);
}

// The GPU planner: the balanced work queue of plan.py (plan_workqueue with target_items), built
// on the device from device sequence lengths, so a whole step (plan + layers) needs no host
// round trip. One CTA of 1024 threads; batch <= PKV_PLAN_MAX_ROWS.
//   W = B * Hkv / target + 1,  cap = W * target
//   closed = max(min_chunk_tiles, ceil(Hkv * sum_i T_i / (cap - B * Hkv)))   (always fits)
//   chunk_rule 0 ("min"): chunk = the smallest c >= min_chunk_tiles with Hkv * sum_i ceil(T_i / c) <= cap,
//     by bisection on [max(min_chunk_tiles, ceil(Hkv * sum_i T_i / cap)), closed], one block-wide
//     sum per halving (plan.balanced_chunk_tiles); chunk_rule 1 ("closed"): chunk = closed
//   S_i = ceil(T_i / chunk)
//   item index of (row i, head h, split s) = Hkv * off_i + h * S_i + s,  off = exclusive scan of S
//   pool_units > 0 and n <= target_items: rows with S_i >= 2 keep T_i * pool_units / 16 tiles in a
//     pool shared by their items (plan.pooled_items): the items' ranges span Ts = T - P tiles and
//     the pool is [min(N, Ts * 32), N)
#define PKV_PLAN_THREADS 1024
#define PKV_PLAN_MAX_ROWS 4096
extern "C" __global__ void __launch_bounds__(PKV_PLAN_THREADS) pkv_plan(
    const int* seq_lens, const int* kv_indptr, int batch, int num_kv_heads, int target_items,
    int min_chunk_tiles, int chunk_rule, int max_items, int pool_units, int* items, int* num_items) {
  __shared__ int s_off[PKV_PLAN_MAX_ROWS + 1];
  __shared__ int s_split[PKV_PLAN_MAX_ROWS];
  __shared__ long long s_warp[32];
  __shared__ long long s_count[32];
  __shared__ int s_scan[PKV_PLAN_THREADS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int TILE_TOKENS = 32;

  // Contiguous rows per thread; their tile counts wait in s_split (each thread reads only its own).
  const int per = (batch + PKV_PLAN_THREADS - 1) / PKV_PLAN_THREADS;
  const int r0 = min(batch, tid * per), r1 = min(batch, r0 + per);
  long long tiles = 0;
  for (int i = r0; i < r1; ++i) {
    const int T = (seq_lens[i] + TILE_TOKENS - 1) / TILE_TOKENS;
    s_split[i] = T;
    tiles += T;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tiles += __shfl_xor_sync(0xffffffffu, tiles, o);
  if (lane == 0) s_warp[warp] = tiles;
  __syncthreads();
  if (warp == 0) {
    long long t = s_warp[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (lane == 0) s_warp[0] = t;
  }
  __syncthreads();
  const long long total = s_warp[0];
  // plan.balanced_chunk_tiles: whole waves of target_items.
  const long long pairs = (long long)batch * num_kv_heads;
  const long long cap = (pairs / target_items + 1) * target_items;
  const long long room = cap - pairs;
  long long hi = (num_kv_heads * total + room - 1) / room;
  if (hi < min_chunk_tiles) hi = min_chunk_tiles;
  if (chunk_rule == 0) {
    long long lo = (num_kv_heads * total + cap - 1) / cap;
    if (lo < min_chunk_tiles) lo = min_chunk_tiles;
    while (lo < hi) {  // lo and hi are the same in every thread: the loop is uniform
      const long long mid = (lo + hi) >> 1;
      long long count = 0;
      for (int i = r0; i < r1; ++i) count += (s_split[i] + mid - 1) / mid;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
      if (lane == 0) s_count[warp] = count;
      __syncthreads();
      long long sum = 0;
#pragma unroll 8
      for (int w = 0; w < PKV_PLAN_THREADS / 32; ++w) sum += s_count[w];
      __syncthreads();  // every thread has read s_count before the next halving writes it
      if (num_kv_heads * sum <= cap) hi = mid; else lo = mid + 1;
    }
  }
  const long long chunk = hi;

  // Split counts, then a block-wide exclusive scan of the per-thread sums.
  int mine = 0;
  for (int i = r0; i < r1; ++i) {
    const int S = (int)((s_split[i] + chunk - 1) / chunk);
    s_split[i] = S;
    mine += S;
  }
  s_scan[tid] = mine;
  __syncthreads();
  for (int off = 1; off < PKV_PLAN_THREADS; off <<= 1) {  // Hillis-Steele inclusive scan
    const int add = tid >= off ? s_scan[tid - off] : 0;
    __syncthreads();
    s_scan[tid] += add;
    __syncthreads();
  }
  int run = s_scan[tid] - mine;
  for (int i = r0; i < r1; ++i) {
    s_off[i] = run;
    run += s_split[i];
  }
  if (tid == PKV_PLAN_THREADS - 1) s_off[batch] = s_scan[tid];
  __syncthreads();
  const int n = num_kv_heads * s_off[batch];
  if (tid == 0) *num_items = n <= max_items ? n : -1;  // -1: bound violated (cannot happen)
  if (n > max_items) return;
  for (int j = tid; j < n; j += PKV_PLAN_THREADS) {
    int a = 0, b = batch - 1;  // last row i with Hkv * s_off[i] <= j
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if (num_kv_heads * s_off[mid] <= j) a = mid; else b = mid - 1;
    }
    const int i = a;
    const int S = s_split[i];
    const int local = j - num_kv_heads * s_off[i];
    const int h = local / S, s = local - h * S;
    const int N = seq_lens[i];
    const long long T = (N + TILE_TOKENS - 1) / TILE_TOKENS;
    const long long Ts = pool_units > 0 && n <= target_items && S >= 2 ? T - T * pool_units / 16 : T;
    const int lo = (int)min((long long)N, (Ts * s) / S * TILE_TOKENS);
    const int hi = (int)min((long long)N, (Ts * (s + 1)) / S * TILE_TOKENS);
    const int pool_lo = Ts < T ? (int)min((long long)N, Ts * TILE_TOKENS) : 0, pool_hi = Ts < T ? N : 0;
    int4* dst = reinterpret_cast<int4*>(items) + 2 * j;
    dst[0] = make_int4(i | (h << 16), lo, hi, s | (S << 16));
    dst[1] = make_int4(kv_indptr[i], pool_lo, pool_hi, 0);
  }
}
