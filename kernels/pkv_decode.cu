// PersistentKV split decode over a paged KV cache (NHD), with the merge of partial states.
//
// Device code only: every decision (which items exist, how many splits, which launches) is made
// by a planner (src/persistentkv/plan.py on the host, pkv_plan below
// on the device); these kernels execute items.
//
// Configuration, fixed per compiled module by macros (the engine compiles one module per
// (dtype, head_dim, warps)):
//   PKV_HEAD_DIM   64 | 128 | 256
//   PKV_BF16       0 -> fp16 (__half), 1 -> bf16 (__nv_bfloat16): Q, the output, the mma inputs
//   PKV_FP8        0 -> K/V of the same dtype; 1 -> K/V are FP8 e4m3 codes, dequantised in registers
//                  (dequant4) and scaled per tensor or per kv head (k_scale, v_scale, read on the device)
//   PKV_WARPS      4 (default) | 8 (head_dim <= 128 only)
//   PKV_TRACE      0 | 1: CTA timestamps (kernels/pkv_trace.cuh; DecodeEngine(trace=True) only)
//
// Kernels:
//   pkv_decode        one CTA per work item; writes a partial state (or the output when the item is
//                     its row's only split); pkv_merge then combines the partial states.
//   pkv_decode_fused  the same, and the last CTA of each (row, kv head) to finish merges the group
//                     (in two levels past MERGE_FANIN splits: arrive_and_merge).
//   pkv_merge         one CTA per merge group.
//   pkv_plan          the balanced work queue, built on the device from device lengths.
//
// One CTA runs one work item (row, kv head, token range [lo, hi)) for ALL G = Hq/Hkv query heads
// of that kv head, so each K/V byte is read from HBM once. WARPS warps; a pipeline stage is a tile
// of TILE = 16 * WARPS tokens (16 per warp); K and V tiles stream into shared memory with cp.async
// (16-byte chunks, XOR-swizzled so ldmatrix is bank-conflict free), STAGES deep. Per item:
//   prologue   (load_item, fetch_pages) the item and the page ids of the first STAGES tiles
//   Q          (load_q) 16 rows x D: registers (D <= 128) or shared memory (D = 256)
//   loop       per tile t: wait for tile t, issue tile t + STAGES - 1, then per warp (compute_tile)
//                S[16 x 16] = Q[16 x D] K^T    rows = query heads (rows >= G are zero padding),
//                                              cols = the warp's 16 tokens
//                online softmax in base 2 (scale * log2(e) folded into S)
//                O[16 x D] += P[16 x 16] V[16 x D]      (mma.m16n8k16, fp32 accumulate)
//   combine    (combine_warps) the WARPS warps' (m, l, O) through shared memory, one barrier
//   store      the output (one split) or the partial state (o normalised, lse in log2 units) at
//              slot = item index, then (fused) the arrival, and the last CTA's merge_group:
//                M = max_s lse_s;  w_s = 2^(lse_s - M);  out = sum_s w_s o_s / sum_s w_s  (0 if empty)
//              in one level up to MERGE_FANIN splits, in two above (arrive_and_merge)
//
// Napkin math (H200, Hq=32, Hkv=8, D=128, fp16): a token costs 2*8*128*2 = 4 KB of K+V over all
// heads; a 64-token stage of one kv head is 32 KB; 3 stages = 96 KB of shared memory, so two
// 4-warp CTAs per SM keep up to ~128 KB of loads in flight per SM, well above the ~35 KB that
// 4.5 TB/s x ~1 us latency / 132 SMs needs. With 8 warps a stage is 128 tokens (64 KB) and
// 3 stages take 192 KB, so one CTA per SM keeps the same bytes in flight as two 4-warp CTAs: the
// module for queues of one item per SM (plan's choose_warps picks it per step).
//
// FP8 (PKV_FP8): the same pipeline over 1-byte e4m3 codes, half the bytes per stage (3 stages x
// 64 tokens x 128 B = 24 KB each of K and V at 4 warps), so the same ~64 KB stay in flight per SM
// at two CTAs; each thread turns 4 codes into two mma registers with 2 shifts and 4 logic ops
// (dequant4; bf16 adds 2 multiplies), ~0.5 instructions per code against the ~0.5 us a 32 KB
// stage of a kv head takes to arrive. The K scale is folded into the score scale, the V scale into
// the output's normalisation, once per item: no multiply per code.

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
#ifndef PKV_TRACE
#define PKV_TRACE 0
#endif
#ifndef PKV_FP8
#define PKV_FP8 0
#endif

#if PKV_BF16
typedef __nv_bfloat16 kv_t;
typedef __nv_bfloat162 kv2_t;
#else
typedef __half kv_t;
typedef __half2 kv2_t;
#endif
// The cache's element: the dtype itself, or an FP8 e4m3 code.
#if PKV_FP8
typedef unsigned char cache_t;
#else
typedef kv_t cache_t;
#endif

#if PKV_TRACE
#include "pkv_trace.cuh"
#else
namespace pkv {
__device__ __forceinline__ void stamp(int) {}
__device__ __forceinline__ void trace_merged(int) {}
}  // namespace pkv
#define PKV_TRACE_BEGIN
#define PKV_TRACE_END(slot, it)
#endif

namespace pkv {

constexpr int D = PKV_HEAD_DIM;
constexpr int WARPS = PKV_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int TILE = 16 * WARPS;                 // tokens per pipeline stage
constexpr bool FP8 = PKV_FP8;
constexpr int ROW_BYTES = D * (int)sizeof(cache_t);  // one token row of one head in the cache
constexpr int CHUNKS = ROW_BYTES / 16;           // 16-byte chunks per token row of one head
constexpr int Q_CHUNKS = D / 8;                  // 16-byte chunks per query row
constexpr int ROWS_PER_PASS = THREADS / CHUNKS;  // token rows one pass of all threads loads
constexpr int LOADS = TILE / ROWS_PER_PASS;      // chunks per thread per tile (each of K and V)
constexpr int STAGES = (D == 256) ? 2 : 3;  // FP8 too: 6 stages of codes ran 1-8 % slower (NOTES)
constexpr int STAGE_BYTES = TILE * ROW_BYTES;    // bytes of K (or V) per stage
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
// 8-warp CTA by default, 256 threads either way, so the register cap stays 255 per thread; two
// 8-warp CTAs would cap it at 128 and the decode kernels (158-199 registers) would spill.
// PKV_CTAS_PER_SM raises it for the FP8 4-warp modules, whose 48 KB of stages leave room for 3 or
// 4 CTAs per SM (registers <= 168 or <= 128): more warps to hide the FP8 loop's conversion and
// mma latencies, chosen per step (choose.choose_ctas_per_sm; benchmarks/NOTES.md, FP8).
#ifdef PKV_CTAS_PER_SM
constexpr int MIN_BLOCKS = PKV_CTAS_PER_SM;
static_assert(WARPS == 4 && MIN_BLOCKS >= 2 && MIN_BLOCKS <= 4, "PKV_CTAS_PER_SM: 2-4 CTAs of 4 warps");
#else
constexpr int MIN_BLOCKS = WARPS == 4 ? 2 : 1;
#endif
static_assert(THREADS % CHUNKS == 0 && TILE % ROWS_PER_PASS == 0, "load mapping");
static_assert(CHUNKS == 4 || CHUNKS % 8 == 0, "the swizzle (swzb) covers rows of 4 or 8k chunks");

// Shared memory of the decode kernel: the K/V pipeline, reused after the loop for the
// cross-warp combine (WARPS x 16 rows x OBUF_STRIDE floats + small row arrays).
constexpr int PIPE_BYTES = Q_ELEMS * 2 + 2 * STAGES * STAGE_BYTES;
constexpr int COMBINE_BYTES = (WARPS * 16 * OBUF_STRIDE + 4 * WARPS * 16 + 64) * 4;
constexpr int SMEM_BYTES = PIPE_BYTES > COMBINE_BYTES ? PIPE_BYTES : COMBINE_BYTES;
// -inf as a bit pattern (no <math.h> under NVRTC).
#define NEG_INF __int_as_float(0xff800000)

struct Item {
  int row, head, lo, hi, split, nsplit, page_base;
};

// Items are 8 ints (two int4): (row | head << 16, lo, hi, split | nsplit << 16, page_base, 0, 0, 0).
// Loaded by volatile asm, which the compiler keeps where it is written (PKV_ITEM_OR_RETURN).
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
  return it;
}
// Q by non-coherent vector loads (the SASS of __ldg).
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

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes: masked tokens read as zeros, never as stale data.
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
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

// Swizzled element offset of (query row t, 16-byte chunk c) of Q in shared memory (Q_SMEM).
__device__ __forceinline__ int swz(int t, int c) { return t * D + ((c ^ (t & 7)) << 3); }
// Swizzled byte offset of (token row t, 16-byte chunk c) inside one stage of K or V: the 8 rows an
// ldmatrix reads at one chunk column land in 8 different 16-byte bank groups. Rows of 8k chunks
// XOR the chunk with t mod 8; rows of 4 chunks (FP8 at head_dim 64, two rows per 128 bytes) XOR
// it with (t / 2) mod 4, the row's parity picking the half.
__device__ __forceinline__ int swzb(int t, int c) {
  return t * ROW_BYTES + ((c ^ (CHUNKS == 4 ? (t >> 1) & 3 : t & 7)) << 4);
}

// FP8 e4m3 codes x0..x3 (the bytes of r, x0 lowest) to two pairs of the mma dtype: ev = (x0, x2),
// od = (x1, x3) (low half first), and for K dequant4_k: (x0, x1) and (x2, x3) where the conversion
// yields those pairs without a byte permute (K_PAIRS; load_q orders Q's dims to match). fp16 on
// sm_89+: cvt.rn.f16x2.e4m3x2. Otherwise by bits: the code's sign to the sign, its 7 exponent-and-mantissa
// bits under the dtype's exponent field, so every code (subnormals too) becomes an exact value
// times a power of two: fp16: value x 2^-8, whose 2^8 is folded into the scales (FP8_SCALE_BIAS);
// bf16: value x 2^-120, multiplied back here (in fp32 the products would underflow). The NaN codes
// become finite; the step's quantiser never writes them.
#if PKV_BF16
constexpr float FP8_SCALE_BIAS = 1.f;
__device__ __forceinline__ void dequant4(unsigned r, unsigned& ev, unsigned& od) {
  const unsigned s = r << 8;
  unsigned o = (r & 0x80008000u) | ((r >> 4) & 0x07F007F0u);
  unsigned e = (s & 0x80008000u) | ((s >> 4) & 0x07F007F0u);
  const kv2_t bias = __floats2bfloat162_rn(0x1p120f, 0x1p120f);
  kv2_t eo = __hmul2(*reinterpret_cast<kv2_t*>(&e), bias);
  kv2_t oo = __hmul2(*reinterpret_cast<kv2_t*>(&o), bias);
  ev = *reinterpret_cast<unsigned*>(&eo);
  od = *reinterpret_cast<unsigned*>(&oo);
}
constexpr bool K_PAIRS = false;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// fp16 on sm_89+: the hardware conversion, exact (every e4m3 value is an fp16 value), 3-7 % faster
// than the bit operations below on the H200 (NOTES, "FP8 caches")
constexpr float FP8_SCALE_BIAS = 1.f;
// K's codes in the pairs they arrive in, (x0, x1) and (x2, x3): 16 byte permutes fewer per warp and
// tile than dequant4, 0.5-4.4 % faster on the H200 (NOTES, "FP8 caches", kpair)
constexpr bool K_PAIRS = true;
__device__ __forceinline__ void dequant4_k(unsigned r, unsigned& lo, unsigned& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(r));
}
__device__ __forceinline__ void dequant4(unsigned r, unsigned& ev, unsigned& od) {
  dequant4_k(__byte_perm(r, 0u, 0x3120), ev, od);  // x0, x2, x1, x3: the pairs (x0, x2), (x1, x3)
}
#else
constexpr float FP8_SCALE_BIAS = 256.f;
__device__ __forceinline__ void dequant4(unsigned r, unsigned& ev, unsigned& od) {
  const unsigned s = r << 8;
  od = (r & 0x80008000u) | ((r >> 1) & 0x3F803F80u);
  ev = (s & 0x80008000u) | ((s >> 1) & 0x3F803F80u);
}
constexpr bool K_PAIRS = false;
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890 || PKV_BF16
__device__ __forceinline__ void dequant4_k(unsigned r, unsigned& ev, unsigned& od) { dequant4(r, ev, od); }
#endif

struct Params {
  const kv_t* q;         // [B, Hq, D] with strides q_sb, q_sh (elements)
  const cache_t* k;      // [pages, P, Hkv, D]: page stride kv_sp, token stride kv_st, head stride D
  const cache_t* v;
  kv_t* out;             // [B, Hq, D] with strides o_sb, o_sh
  float* lse;            // [B, Hq] contiguous, natural-log LSE of the scaled scores; nullptr: not asked for
  const float* k_scale;  // FP8: kv head h's K and V scales at h * s_sh (s_sh 0: one per tensor)
  const float* v_scale;
  const int* kv_indices; // CSR page ids; a row's pages start at item.page_base
  const int4* items;     // [n, 2] int4 (8 ints per item)
  const int* num_items;  // device item count (GPU-planned launches) or nullptr
  float* part_o;         // [slots, G, D]
  float* part_lse;       // [slots, G], log2 units
  int* counters;         // [slots], zero between launches: the fused merge's arrivals (arrive_and_merge)
  int slot_offset;       // slot of this launch's first item
  int num_kv_heads, group_size, log2_page;
  long long kv_sp, kv_st;
  long long q_sb, q_sh, o_sb, o_sh, s_sh;
  float scale_log2;      // softmax scale * log2(e)
};

// One split's share of a merge: acc += w * o, den += w.
__device__ __forceinline__ void fold(float4& acc, float& den, float w, const float4& o) {
  den += w;
  acc.x += w * o.x;
  acc.y += w * o.y;
  acc.z += w * o.z;
  acc.w += w * o.w;
}

// ln(2): the LSE is kept in log2 units of the scaled scores and handed out in natural-log units.
constexpr float LN2 = 0.693147180559945f;

// The row's LSE of query head qh (natural log), from a base-2 state: m2 + log2(den), -inf if empty.
// An opaque store: a plain one may alias the float partial states, so the compiler would keep the
// merge's next state loads behind it (pkv_merge fell from 242 to 110 registers and its separate
// merge launch ran 1-6 % slower at B=1 up to 32K, paired against the build without an LSE).
__device__ __forceinline__ void write_lse(const Params& p, int row, int qh, float lse2) {
  float* dst = p.lse + (long long)row * (p.num_kv_heads * p.group_size) + qh;
  asm volatile("st.global.f32 [%0], %1;\n" :: "l"(dst), "f"(lse2 * LN2));
}

// A merged float4 of query head qh (of the row): out = acc / den, 0 when every split was empty;
// with its LSE (m + log2(den)) when asked for, written once per query head (d == 0).
__device__ __forceinline__ void write_merged(const Params& p, int row, int qh, int d, const float4& acc, float den,
                                             float m) {
  const float inv = den > 0.f ? 1.f / den : 0.f;
  if (p.lse != nullptr && d == 0) write_lse(p, row, qh, den > 0.f ? m + __log2f(den) : NEG_INF);
  kv_t* dst = p.out + row * p.o_sb + (long long)qh * p.o_sh + d;
  dst[0] = to_kv(acc.x * inv);
  dst[1] = to_kv(acc.y * inv);
  dst[2] = to_kv(acc.z * inv);
  dst[3] = to_kv(acc.w * inv);
}

// Fold the partial states at slots base, base + stride, ..., base + (n - 1) * stride for query
// head g (of the kv head), float4 d of its output: m = max lse, den = sum 2^(lse - m), acc = sum
// 2^(lse - m) o. The thread walks the n states in chunks of MERGE_UNROLL, loading a chunk's lse
// values and o columns together (all in flight) and folding them in with an online softmax over
// splits: no shared memory, no barrier, about n / MERGE_UNROLL L2 round trips. Threads of a warp
// share g, so their lse loads coalesce.
constexpr int MERGE_UNROLL = 16;
__device__ __forceinline__ void fold_states(const Params& p, int base, int n, int stride, int g, int d, float& m,
                                            float& den, float4& acc) {
  const int G = p.group_size;
  const float* lse = p.part_lse + (long long)base * G + g;
  const float* col = p.part_o + ((long long)base * G + g) * D + d;
  const long long lse_step = (long long)stride * G, o_step = (long long)stride * G * D;
  m = NEG_INF;
  den = 0.f;
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < n; s0 += MERGE_UNROLL) {
    float l[MERGE_UNROLL];
    float4 o[MERGE_UNROLL];
#pragma unroll
    for (int u = 0; u < MERGE_UNROLL; ++u) {
      const bool ok = s0 + u < n;
      l[u] = ok ? __ldcg(lse + (s0 + u) * lse_step) : NEG_INF;
      o[u] = ok ? __ldcg(reinterpret_cast<const float4*>(col + (s0 + u) * o_step)) : make_float4(0.f, 0.f, 0.f, 0.f);
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
}

// Fold states (fold_states) for every (query head g, float4 d) of a kv head, one per thread in
// turn, handing each result to ``emit(g, d, m, den, acc)``.
template <typename Emit>
__device__ __forceinline__ void fold_each(const Params& p, int base, int n, int stride, Emit emit) {
  constexpr int D4 = D / 4;
  for (int idx = threadIdx.x; idx < p.group_size * D4; idx += THREADS) {
    const int g = idx / D4, d = (idx - g * D4) * 4;
    float m, den;
    float4 acc;
    fold_states(p, base, n, stride, g, d, m, den, acc);
    emit(g, d, m, den, acc);
  }
}

// Merge the partial states of one (row, kv head) into its output: slots base, base + stride, ...
// (n of them). Each thread owns one float4 of one query head's output.
__device__ void merge_group(const Params& p, int row, int head, int base, int n, int stride = 1) {
  fold_each(p, base, n, stride, [&](int g, int d, float m, float den, const float4& acc) {
    write_merged(p, row, head * p.group_size + g, d, acc, den, m);
  });
}

// Merge the n partial states at slots [base, base + n) into one, written over slot base's: o
// normalised, lse = m + log2(den) (-inf when every split was empty), so that merging it with
// others weighs it as the sum of its splits' weights. Each thread reads and writes only its own
// float4 of o, so o is written in place; the lse a query head's threads all read is staged in
// shared memory (``stage``, G floats) and written after a barrier.
__device__ void merge_in_place(const Params& p, int base, int n, float* stage) {
  const int G = p.group_size;
  fold_each(p, base, n, 1, [&](int g, int d, float m, float den, const float4& acc) {
    const float inv = den > 0.f ? 1.f / den : 0.f;
    *reinterpret_cast<float4*>(p.part_o + ((long long)base * G + g) * D + d) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (d == 0) stage[g] = den > 0.f ? m + __log2f(den) : NEG_INF;
  });
  __syncthreads();  // every thread has read slot base's lse values
  for (int g = threadIdx.x; g < G; g += THREADS) p.part_lse[(long long)base * G + g] = stage[g];
}

// Where this thread's loads of an item go: the item's pages and tokens, the cache's bytes, and
// the thread's load slots (chunk lc of token rows lr + ROWS_PER_PASS * i of a tile).
struct Loader {
  const int* pages;      // the row's page ids
  const char* kbytes;    // K and V of this kv head
  const char* vbytes;
  unsigned sp_b, st_b;   // page and token strides in bytes (below 4 GB: DecodeEngine checks)
  int lo, hi, log2_page, p_mask;
  int lc, lr;
};

// Page ids of tile ``tile``'s token rows that this thread loads (0 past hi: never read).
__device__ __forceinline__ void fetch_pages(const Loader& ld, int tile, int (&pg)[LOADS]) {
  const int t0 = ld.lo + tile * TILE;
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const int tok = t0 + ld.lr + ROWS_PER_PASS * i;
    pg[i] = tok < ld.hi ? __ldg(ld.pages + (tok >> ld.log2_page)) : 0;
  }
}

// cp.async loads of tile ``tile`` into its stage of sK and sV, in bursts of up to BURST rows: every
// address of a burst first, then its K loads, then its V loads. Interleaved with the address
// math, the 8-warp loop took 3-6 % longer (NOTES, "The two-level merge and the plain launch");
// bursts of 16 rows (head_dim 256) would hold 16 64-bit offsets and spill.
// A token row's byte offset from its page id is one 32 x 32 -> 64-bit multiply-add
// (IMAD.WIDE.U32) of the byte strides: 64-bit math took ~20 instructions per K/V load pair, in the
// loop's critical section between a tile's landing and the next tile's loads (NOTES, v17).
constexpr int BURST = LOADS < 8 ? LOADS : 8;
static_assert(LOADS % BURST == 0, "bursts tile the loads");
__device__ __forceinline__ void issue_stage(const Loader& ld, unsigned char* sK, unsigned char* sV, int tile,
                                            const int (&pg)[LOADS]) {
  const unsigned dK = smem_u32(sK + (tile % STAGES) * STAGE_BYTES);
  const unsigned dV = smem_u32(sV + (tile % STAGES) * STAGE_BYTES);
  const int t0 = ld.lo + tile * TILE;
#pragma unroll
  for (int b = 0; b < LOADS; b += BURST) {
    unsigned long long off[BURST];
    bool valid[BURST];
#pragma unroll
    for (int u = 0; u < BURST; ++u) {
      const int tok = t0 + ld.lr + ROWS_PER_PASS * (b + u);
      valid[u] = tok < ld.hi;
      // past hi: page id 0 (fetch_pages) and an in-page offset, an address of the cache that
      // src-size 0 never reads
      off[u] = (unsigned long long)(unsigned)pg[b + u] * ld.sp_b + ((unsigned)(tok & ld.p_mask) * ld.st_b + ld.lc * 16u);
    }
#pragma unroll
    for (int u = 0; u < BURST; ++u)
      cp_async16(dK + swzb(ld.lr + ROWS_PER_PASS * (b + u), ld.lc), ld.kbytes + off[u], valid[u]);
#pragma unroll
    for (int u = 0; u < BURST; ++u)
      cp_async16(dV + swzb(ld.lr + ROWS_PER_PASS * (b + u), ld.lc), ld.vbytes + off[u], valid[u]);
  }
}

// Q fragments (A operand, 16 rows = query heads of this kv head, zero beyond G): into registers,
// or (Q_SMEM) into sQ, visible after the loop's first barrier.
// FP8: the dims of each group of 16 are permuted to the order in which dequant4_k hands out a
// thread's 4 consecutive K dims: K_PAIRS, mma k position 2j + e holds dim 4j + e and position
// 8 + 2j + e dim 4j + 2 + e; otherwise evens first, then odds (2j + e holds dim 4j + 2e, 8 + 2j + e
// dim 4j + 1 + 2e). q.k sums over the dims, so permuting both leaves it unchanged.
__device__ __forceinline__ void load_q(const Params& p, const Item& it, kv_t* sQ,
                                       unsigned (&qf)[Q_SMEM ? 1 : D / 16][4]) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int G = p.group_size;
  if constexpr (Q_SMEM) {
    if constexpr (FP8) {  // one thread per (row, 16 dims): both chunks, evens then odds
      for (int idx = tid; idx < 16 * Q_CHUNKS / 2; idx += THREADS) {
        const int g = idx / (Q_CHUNKS / 2), c = (idx - g * (Q_CHUNKS / 2)) * 2;
        uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
        if (g < G) {
          const kv_t* src = p.q + it.row * p.q_sb + (long long)(it.head * G + g) * p.q_sh + c * 8;
          a = ld_nc_v4(src);
          b = ld_nc_v4(src + 8);
        }
        const uint4 ev = K_PAIRS ? make_uint4(a.x, a.z, b.x, b.z) :
                         make_uint4(__byte_perm(a.x, a.y, 0x5410), __byte_perm(a.z, a.w, 0x5410),
                                    __byte_perm(b.x, b.y, 0x5410), __byte_perm(b.z, b.w, 0x5410));
        const uint4 od = K_PAIRS ? make_uint4(a.y, a.w, b.y, b.w) :
                         make_uint4(__byte_perm(a.x, a.y, 0x7632), __byte_perm(a.z, a.w, 0x7632),
                                    __byte_perm(b.x, b.y, 0x7632), __byte_perm(b.z, b.w, 0x7632));
        *reinterpret_cast<uint4*>(sQ + swz(g, c)) = ev;
        *reinterpret_cast<uint4*>(sQ + swz(g, c + 1)) = od;
      }
    } else {
      for (int idx = tid; idx < 16 * Q_CHUNKS; idx += THREADS) {
        const int g = idx / Q_CHUNKS, c = idx - g * Q_CHUNKS;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (g < G) val = ld_nc_v4(p.q + it.row * p.q_sb + (long long)(it.head * G + g) * p.q_sh + c * 8);
        *reinterpret_cast<uint4*>(sQ + swz(g, c)) = val;
      }
    }
  } else {
    const int g0 = lane >> 2, g1 = g0 + 8;
    const kv_t* q0 = p.q + it.row * p.q_sb + (long long)(it.head * G + g0) * p.q_sh;
    const kv_t* q1 = p.q + it.row * p.q_sb + (long long)(it.head * G + g1) * p.q_sh;
#pragma unroll
    for (int kk = 0; kk < (Q_SMEM ? 1 : D / 16); ++kk) {
      if constexpr (FP8) {  // dims 4j..4j+3 (j = lane % 4): (4j, 4j+1) and (4j+2, 4j+3) under K_PAIRS,
                            // else (4j, 4j+2) and (4j+1, 4j+3)
        const int c = (lane & 3) * 4;
        const unsigned a0 = g0 < G ? ld_nc_u32(q0 + kk * 16 + c) : 0u, a1 = g0 < G ? ld_nc_u32(q0 + kk * 16 + c + 2) : 0u;
        const unsigned b0 = g1 < G ? ld_nc_u32(q1 + kk * 16 + c) : 0u, b1 = g1 < G ? ld_nc_u32(q1 + kk * 16 + c + 2) : 0u;
        qf[kk][0] = K_PAIRS ? a0 : __byte_perm(a0, a1, 0x5410);
        qf[kk][2] = K_PAIRS ? a1 : __byte_perm(a0, a1, 0x7632);
        qf[kk][1] = K_PAIRS ? b0 : __byte_perm(b0, b1, 0x5410);
        qf[kk][3] = K_PAIRS ? b1 : __byte_perm(b0, b1, 0x7632);
      } else {
        const int c = (lane & 3) * 2;
        qf[kk][0] = g0 < G ? ld_nc_u32(q0 + kk * 16 + c) : 0u;
        qf[kk][1] = g1 < G ? ld_nc_u32(q1 + kk * 16 + c) : 0u;
        qf[kk][2] = g0 < G ? ld_nc_u32(q0 + kk * 16 + 8 + c) : 0u;
        qf[kk][3] = g1 < G ? ld_nc_u32(q1 + kk * 16 + 8 + c) : 0u;
      }
    }
  }
}

// One warp's online-softmax state: O (16 rows x D, in mma C fragments), row maxima m and sums l of
// rows g = lane / 4 (0) and g + 8 (1), in base 2.
struct WarpState {
  float o[NT][4];
  float m0, m1, l0, l1;
};

// Q's A fragment of k step kk (16 dims): from registers, or (Q_SMEM) by ldmatrix from sQ.
__device__ __forceinline__ void q_frag(const kv_t* sQ, const unsigned (&qf)[Q_SMEM ? 1 : D / 16][4], int kk,
                                       unsigned (&a)[4]) {
  if constexpr (Q_SMEM) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    ldsm_x4(smem_u32(sQ + swz((mi & 1) * 8 + r, 2 * kk + (mi >> 1))), a[0], a[1], a[2], a[3]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = qf[Q_SMEM ? 0 : kk][i];
  }
}

// One warp's 16 tokens of one landed tile, tokens [tok0, tok0 + 16) with those >= t_hi masked:
// S = Q K^T on tensor cores, mask and scale to base 2 (qk_scale: softmax scale x log2(e), x the
// kv head's K scale under FP8), online softmax, O += P V.
// FP8: K and V tiles hold codes; one ldmatrix x4 reads 8 tokens x 16 codes per 8x8 b16 matrix and
// dequant4_k (K) and dequant4 (V) turn each thread's 4 codes into its two B registers. K (not
// transposed): a thread's 4 consecutive dims of one token (Q's dims are permuted to match:
// load_q). V (transposed): a thread's 2 tokens x 2 adjacent dims (2n, 2n+1); the even dims feed
// one n8 block (o[2c]), the odd ones the next (o[2c + 1]), so o[2c] holds dims 16c + 4j + {0, 2}
// and o[2c + 1] dims 16c + 4j + {1, 3} (j = lane % 4): combine_and_store puts them back in order.
__device__ __forceinline__ void compute_tile(float qk_scale, const kv_t* sQ, const unsigned (&qf)[Q_SMEM ? 1 : D / 16][4],
                                             const unsigned char* k_st, const unsigned char* v_st, int tok0, int t_hi,
                                             WarpState& ws) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float s[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  const int mi = lane >> 3, r = lane & 7;
  if constexpr (FP8) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks kk | kk + 1
      const int tk = warp * 16 + (mi & 1) * 8 + r;
      unsigned c[4];
      ldsm_x4(smem_u32(k_st + swzb(tk, kk + (mi >> 1))), c[0], c[1], c[2], c[3]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned a[4], e0, o0, e1, o1;
        q_frag(sQ, qf, kk + h, a);
        dequant4_k(c[2 * h], e0, o0);
        dequant4_k(c[2 * h + 1], e1, o1);
        mma16816(s[0], a, e0, o0);
        mma16816(s[1], a, e1, o1);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int tk = warp * 16 + (mi >> 1) * 8 + r;
      unsigned b0, b1, b2, b3, a[4];
      ldsm_x4(smem_u32(k_st + swzb(tk, 2 * kk + (mi & 1))), b0, b1, b2, b3);
      q_frag(sQ, qf, kk, a);
      mma16816(s[0], a, b0, b1);
      mma16816(s[1], a, b2, b3);
    }
  }
  // Mask, scale to base 2, online softmax (rows g = lane/4 and g + 8).
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
      s[j][e] = tok < t_hi ? s[j][e] * qk_scale : NEG_INF;
    }
    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float mn0 = fmaxf(ws.m0, mx0), mn1 = fmaxf(ws.m1, mx1);
  const float base0 = mn0 == NEG_INF ? 0.f : mn0, base1 = mn1 == NEG_INF ? 0.f : mn1;
  const float a0 = fast_exp2(ws.m0 - base0), a1 = fast_exp2(ws.m1 - base1);
  ws.m0 = mn0;
  ws.m1 = mn1;
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
  ws.l0 = ws.l0 * a0 + ps0;
  ws.l1 = ws.l1 * a1 + ps1;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    ws.o[j][0] *= a0;
    ws.o[j][1] *= a0;
    ws.o[j][2] *= a1;
    ws.o[j][3] *= a1;
  }
  unsigned pa[4];
  pa[0] = pack2(s[0][0], s[0][1]);
  pa[1] = pack2(s[0][2], s[0][3]);
  pa[2] = pack2(s[1][0], s[1][1]);
  pa[3] = pack2(s[1][2], s[1][3]);
  if constexpr (FP8) {
#pragma unroll
    for (int dc = 0; dc < D / 16; dc += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks dc | dc + 1
      const int tv = warp * 16 + (mi & 1) * 8 + r;
      unsigned c[4];
      ldsm_x4_t(smem_u32(v_st + swzb(tv, dc + (mi >> 1))), c[0], c[1], c[2], c[3]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned e0, o0, e1, o1;
        dequant4(c[2 * h], e0, o0);      // tokens 2j, 2j+1
        dequant4(c[2 * h + 1], e1, o1);  // tokens 2j+8, 2j+9
        mma16816(ws.o[2 * (dc + h)], pa, e0, e1);
        mma16816(ws.o[2 * (dc + h) + 1], pa, o0, o1);
      }
    }
  } else {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      const int tv = warp * 16 + (mi & 1) * 8 + r;
      unsigned b0, b1, b2, b3;
      ldsm_x4_t(smem_u32(v_st + swzb(tv, 2 * dp + (mi >> 1))), b0, b1, b2, b3);
      mma16816(ws.o[2 * dp], pa, b0, b1);
      mma16816(ws.o[2 * dp + 1], pa, b2, b3);
    }
  }
}

// Combine the WARPS warps' states through shared memory (the pipeline's buffers, free after the
// loop) and store the item's result: the output when it is its row's only split (direct), else
// its partial state (o normalised, lse in log2 units) at ``slot``. Two adjacent dims per thread;
// each thread derives its row's (M, L) from the WARPS warps' (m, l) itself (broadcast reads) and
// weighs warp w's O by 2^(m_w - M), so one barrier suffices (scaling O before a second barrier
// was 1-2 % slower below ~16K tokens: benchmarks/NOTES.md, "What ships").
// ``v_scale``: the kv head's V scale (FP8), applied to the normalised output; 1 otherwise.
__device__ __forceinline__ void combine_and_store(const Params& p, int slot, const Item& it, bool direct,
                                                  WarpState& ws, kv_t* smem, float v_scale) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = p.group_size;
  ws.l0 += __shfl_xor_sync(0xffffffffu, ws.l0, 1);
  ws.l0 += __shfl_xor_sync(0xffffffffu, ws.l0, 2);
  ws.l1 += __shfl_xor_sync(0xffffffffu, ws.l1, 1);
  ws.l1 += __shfl_xor_sync(0xffffffffu, ws.l1, 2);
  float* obuf = reinterpret_cast<float*>(smem);            // [WARPS][16][OBUF_STRIDE]
  float* redM = obuf + WARPS * 16 * OBUF_STRIDE;            // [WARPS][16]
  float* redL = redM + WARPS * 16;                          // [WARPS][16]
  const int g0 = lane >> 2, g1 = g0 + 8;
  if ((lane & 3) == 0) {
    redM[warp * 16 + g0] = ws.m0;
    redL[warp * 16 + g0] = ws.l0;
    redM[warp * 16 + g1] = ws.m1;
    redL[warp * 16 + g1] = ws.l1;
  }
  if constexpr (FP8) {  // o[2c] and o[2c + 1] hold dims 16c + 4j + {0, 2} and {1, 3}: a float4 in order
    const int c4 = (lane & 3) * 4;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      const float(&e)[4] = ws.o[2 * j];
      const float(&o)[4] = ws.o[2 * j + 1];
      if (g0 < G) *reinterpret_cast<float4*>(obuf + (warp * 16 + g0) * OBUF_STRIDE + j * 16 + c4) = make_float4(e[0], o[0], e[1], o[1]);
      if (g1 < G) *reinterpret_cast<float4*>(obuf + (warp * 16 + g1) * OBUF_STRIDE + j * 16 + c4) = make_float4(e[2], o[2], e[3], o[3]);
    }
  } else {  // each warp's O as it stands, relative to its own row maxima; weighed below, where summed
    const int c = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (g0 < G) *reinterpret_cast<float2*>(obuf + (warp * 16 + g0) * OBUF_STRIDE + j * 8 + c) = make_float2(ws.o[j][0], ws.o[j][1]);
      if (g1 < G) *reinterpret_cast<float2*>(obuf + (warp * 16 + g1) * OBUF_STRIDE + j * 8 + c) = make_float2(ws.o[j][2], ws.o[j][3]);
    }
  }
  __syncthreads();

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
    const float inv = L > 0.f ? (FP8 ? v_scale : 1.f) / L : 0.f;
    const float2 val = make_float2(acc.x * inv, acc.y * inv);
    const float lse = L > 0.f ? M + __log2f(L) : NEG_INF;  // an empty state: o = 0, lse = -inf
    if (direct) {
      kv_t* dst = p.out + it.row * p.o_sb + (long long)(it.head * G + g) * p.o_sh + d;
      dst[0] = to_kv(val.x);
      dst[1] = to_kv(val.y);
      if (p.lse != nullptr && d == 0) write_lse(p, it.row, it.head * G + g, lse);
    } else {
      *reinterpret_cast<float2*>(p.part_o + ((long long)slot * G + g) * D + d) = val;
      if (d == 0) p.part_lse[(long long)slot * G + g] = lse;
    }
  }
}

// Fused merge: the last CTA of a group's splits to finish merges them. After the barrier, one
// thread's acq_rel atomic publishes the whole CTA's partial state (release is cumulative over what
// the barrier ordered before it) and, for the last CTA, acquires the others'; the barrier after it
// extends that to every thread, whose loads then go to L2 (.cg). The last CTA sets the counter
// back to 0, ready for the next launch. Returns whether this CTA arrived last (every thread).
__device__ __forceinline__ bool arrive(int* counter, int expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counter) : "memory");
    const int last = prev == expected - 1;
    if (last) *counter = 0;  // nobody else touches it in this launch: every CTA it counts arrived
    *flag = last;
  }
  __syncthreads();
  return *flag;
}

// A group of up to MERGE_FANIN splits merges in one level: its last CTA folds every partial state
// (one chunk of loads per thread). A larger group merges in two, so that no CTA folds more than
// MERGE_FANIN states: its splits form subgroups of MERGE_FANIN consecutive slots; the last CTA of
// each subgroup merges it into the subgroup's first slot (merge_in_place), and the last of those
// merges the subgroups' slots into the output. With one kv head and one row the whole step is one
// group split hundreds of ways, which one CTA took tens of L2 round trips to merge.
// Counters are per slot (zero between launches): a group's at its first slot, subgroup j's at its
// second slot (base + j * MERGE_FANIN + 1; a subgroup of one split needs none), so no two collide.
constexpr int MERGE_FANIN = 16;
__device__ __forceinline__ void arrive_and_merge(const Params& p, int slot, const Item& it, kv_t* smem) {
  float* smem_f = reinterpret_cast<float*>(smem);
  int* flag = reinterpret_cast<int*>(smem_f + WARPS * 16 * OBUF_STRIDE + 2 * WARPS * 16);
  const int base = slot - it.split;
  int n = it.nsplit, stride = 1;
  if (n > MERGE_FANIN) {
    const int first = it.split - it.split % MERGE_FANIN;
    const int size = min(MERGE_FANIN, n - first);
    if (size > 1) {
      if (!arrive(p.counters + base + first + 1, size, flag)) return;
      merge_in_place(p, base + first, size, smem_f);  // stage: the combine buffer, free by now
    }
    n = (n + MERGE_FANIN - 1) / MERGE_FANIN;
    stride = MERGE_FANIN;
  }
  const bool last = arrive(p.counters + base, n, flag);
  stamp(5);
  trace_merged(last);
  if (!last) return;
  merge_group(p, it.row, it.head, base, n, stride);
}

// One item: its partial state (or output), then (FUSED) the arrival and the group's merge.
template <bool FUSED>
__device__ void decode_item(const Params& p, int slot, const Item& it, kv_t* smem) {
  const int tid = threadIdx.x, warp = tid >> 5;
  kv_t* sQ = smem;
  unsigned char* sK = reinterpret_cast<unsigned char*>(smem + Q_ELEMS);
  unsigned char* sV = sK + STAGES * STAGE_BYTES;

  const int P_mask = (1 << p.log2_page) - 1;
  const cache_t* kbase = p.k + (long long)it.head * D;
  const cache_t* vbase = p.v + (long long)it.head * D;
  // FP8: the kv head's scales (one load each, before the pipeline; a graph replay reads new ones)
  float qk_scale = p.scale_log2, v_scale = 1.f;
  if constexpr (FP8) {
    qk_scale *= __ldg(p.k_scale + it.head * p.s_sh) * FP8_SCALE_BIAS;
    v_scale = __ldg(p.v_scale + it.head * p.s_sh) * FP8_SCALE_BIAS;
  }
  Loader ld;
  ld.pages = p.kv_indices + it.page_base;
  ld.lc = tid % CHUNKS;
  ld.lr = tid / CHUNKS;
  const int ntiles = it.hi > it.lo ? (it.hi - it.lo + TILE - 1) / TILE : 0;
  ld.lo = it.lo;
  ld.hi = it.hi;
  ld.log2_page = p.log2_page;
  ld.p_mask = P_mask;
  ld.sp_b = (unsigned)p.kv_sp * (unsigned)sizeof(cache_t);
  ld.st_b = (unsigned)p.kv_st * (unsigned)sizeof(cache_t);
  ld.kbytes = reinterpret_cast<const char*>(kbase);
  ld.vbytes = reinterpret_cast<const char*>(vbase);

  WarpState ws;
#pragma unroll
  for (int j = 0; j < NT; ++j) ws.o[j][0] = ws.o[j][1] = ws.o[j][2] = ws.o[j][3] = 0.f;
  ws.m0 = ws.m1 = NEG_INF;
  ws.l0 = ws.l1 = 0.f;

  // Prologue: page ids for the first STAGES tiles (independent loads, issued together); tile
  // STAGES - 1's wait in pg_next.
  int pg_next[LOADS];  // the page ids of the next tile to load: t + STAGES - 1 at iteration t
  int pg[STAGES - 1][LOADS];
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < ntiles) fetch_pages(ld, s, pg[s]);
  if (STAGES - 1 < ntiles) fetch_pages(ld, STAGES - 1, pg_next);
  stamp(1);

  unsigned qf[Q_SMEM ? 1 : D / 16][4];
  load_q(p, it, sQ, qf);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {  // one commit group per tile
    if (s < ntiles) issue_stage(ld, sK, sV, s, pg[s]);
    cp_async_commit();
  }

  // The pipeline: wait for tile t, refill the stage tile t - 1 freed with tile t + STAGES - 1
  // (whose page ids were fetched an iteration ago), fetch the ids of tile t + STAGES, compute t.
  bool ahead = STAGES - 1 < ntiles;  // tile t + STAGES - 1 exists and its page ids are in pg_next
  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for every thread; tile t - 1's stages are free again
    if (PKV_TRACE && t == 0) stamp(2);
    if (ahead) {
      issue_stage(ld, sK, sV, t + STAGES - 1, pg_next);
      ahead = t + STAGES < ntiles;
      if (ahead) fetch_pages(ld, t + STAGES, pg_next);  // used one iteration later
    }
    cp_async_commit();
    const int tok0 = it.lo + t * TILE + warp * 16;
    if (tok0 < it.hi)  // warp-uniform: skip warps whose 16 tokens all lie past the item's end
      compute_tile(qk_scale, sQ, qf, sK + (t % STAGES) * STAGE_BYTES, sV + (t % STAGES) * STAGE_BYTES, tok0, it.hi, ws);
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the combine buffers
  stamp(3);

  const bool direct = it.nsplit <= 1;
  combine_and_store(p, slot, it, direct, ws, smem, v_scale);
  stamp(4);
  if (FUSED && !direct) arrive_and_merge(p, slot, it, smem);
}

}  // namespace pkv

using pkv::Params;

// The GPU planner's block (pkv_plan below): threads, and the most rows its shared arrays hold.
#define PKV_PLAN_THREADS 1024
#define PKV_PLAN_MAX_ROWS 4096

// Launch facts the host reads from the module (never restated in Python): dynamic shared
// memory per decode CTA, threads per CTA, tokens per pipeline stage, pipeline stages (of K and of
// V each), planner tile, the planner's threads and its most rows.
extern "C" __device__ const int pkv_config[7] = {pkv::SMEM_BYTES, pkv::THREADS, pkv::TILE, pkv::STAGES, 32,
                                                 PKV_PLAN_THREADS, PKV_PLAN_MAX_ROWS};

// This CTA's slot and item, or return when a GPU-planned launch has fewer items than CTAs. The
// item is loaded together with the count, not after it: its buffer holds every CTA's slot
// (max_items), and a CTA past the count leaves without using what it read. Loaded after the count,
// the item cost each GPU-planned CTA one more global round trip before its first page ids.
// The count is a volatile asm load, and the return tests words of the item as well (never
// negative in a real item: nsplit < 2^15, page_base >= 0), so that ptxas cannot sink the item's
// loads below it.
#define PKV_ITEM_OR_RETURN(slot, it)                                                   \
  const int slot = slot_offset + blockIdx.x;                                           \
  const int pkv_count = num_items != nullptr ? pkv::ld_volatile(num_items) : (int)gridDim.x; \
  const pkv::Item it = pkv::load_item(items, slot);                                   \
  if ((int)blockIdx.x >= pkv_count || it.nsplit < 0 || it.page_base < 0) return

#define PKV_DECODE_ARGS                                                                              \
  const kv_t *q, const cache_t *k, const cache_t *v, kv_t *out, float *lse, const float *k_scale,    \
      const float *v_scale, const int *kv_indices, const int4 *items, const int *num_items,          \
      float *part_o, float *part_lse, int *counters, int slot_offset,                                \
      int num_kv_heads, int group_size, int log2_page, long long kv_sp, long long kv_st,            \
      long long q_sb, long long q_sh, long long o_sb, long long o_sh, long long s_sh, float scale_log2

// The work-queue kernels: pkv_decode writes partial states (a separate pkv_merge combines them),
// pkv_decode_fused merges in the last CTA of each group.
#define PKV_DECODE_KERNEL(NAME, FUSED)                                                                 \
  extern "C" __global__ void __launch_bounds__(pkv::THREADS, pkv::MIN_BLOCKS) NAME(PKV_DECODE_ARGS) { \
    Params p{q, k, v, out, lse, k_scale, v_scale, kv_indices, items, num_items, part_o, part_lse,      \
             counters, slot_offset, num_kv_heads, group_size, log2_page, kv_sp, kv_st, q_sb, q_sh, o_sb,  \
             o_sh, s_sh, scale_log2};                                                                 \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                        \
    PKV_TRACE_BEGIN;                                                                                 \
    PKV_ITEM_OR_RETURN(slot, it);                                                                    \
    pkv::decode_item<FUSED>(p, slot, it, reinterpret_cast<kv_t*>(smem_raw));                        \
    PKV_TRACE_END(slot, it);                                                                         \
  }
PKV_DECODE_KERNEL(pkv_decode, false)
PKV_DECODE_KERNEL(pkv_decode_fused, true)

// One CTA per merge group: groups[i] = (row, kv head, first slot, num splits).
extern "C" __global__ void __launch_bounds__(pkv::THREADS) pkv_merge(
    const int4* groups, const float* part_o, const float* part_lse, kv_t* out, float* lse, int group_size,
    int num_kv_heads, long long o_sb, long long o_sh) {
  const int4 grp = groups[blockIdx.x];
  Params p{};
  p.part_o = const_cast<float*>(part_o);
  p.part_lse = const_cast<float*>(part_lse);
  p.out = out;
  p.lse = lse;
  p.group_size = group_size;
  p.num_kv_heads = num_kv_heads;
  p.o_sb = o_sb;
  p.o_sh = o_sh;
  pkv::merge_group(p, grp.x, grp.y, grp.z, grp.w);
}

// The GPU planner: the balanced work queue of plan.py (plan_workqueue with target_items), built
// on the device from device sequence lengths, so a whole step (plan + layers) needs no host
// round trip. One CTA of 1024 threads; batch <= PKV_PLAN_MAX_ROWS.
//   W = B * Hkv / target + 1,  cap = W * target
//   closed = max(min_chunk_tiles, ceil(Hkv * sum_i T_i / (cap - B * Hkv)))   (always fits)
//   chunk = the smallest c >= min_chunk_tiles with Hkv * sum_i ceil(T_i / c) <= cap, by bisection
//     on [max(min_chunk_tiles, ceil(Hkv * sum_i T_i / cap)), closed], one block-wide sum per
//     halving (plan.balanced_chunk_tiles). Worked numbers (Hkv = 8, target 264): B=1 x 4096 tokens
//     (128 tiles): chunk 4 tiles, 32 splits, 256 items; B=4 x 32768: closed 142, chunk 128, S_i = 8.
//   S_i = ceil(T_i / chunk)
//   item index of (row i, head h, split s) = Hkv * off_i + h * S_i + s,  off = exclusive scan of S
extern "C" __global__ void __launch_bounds__(PKV_PLAN_THREADS) pkv_plan(
    const int* seq_lens, const int* kv_indptr, int batch, int num_kv_heads, int target_items,
    int min_chunk_tiles, int max_items, int* items, int* num_items) {
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
  long long chunk;
  {
    long long hi = (num_kv_heads * total + room - 1) / room;  // the closed form: always fits
    if (hi < min_chunk_tiles) hi = min_chunk_tiles;
    long long lo = (num_kv_heads * total + cap - 1) / cap;    // below it nothing fits
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
    chunk = hi;
  }

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
    const int lo = (int)min((long long)N, (T * s) / S * TILE_TOKENS);
    const int hi = (int)min((long long)N, (T * (s + 1)) / S * TILE_TOKENS);
    int4* dst = reinterpret_cast<int4*>(items) + 2 * j;
    dst[0] = make_int4(i | (h << 16), lo, hi, s | (S << 16));
    dst[1] = make_int4(kv_indptr[i], 0, 0, 0);
  }
}
