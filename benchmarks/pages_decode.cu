// v11 prototype (development; nothing in src/ loads this file): a CTA owns a range of one row's
// pages for ALL kv heads, benchmarks/NOTES.md "v11, sketched", "v13" and "v14" (measured; not adopted).
//
// Shape: fp16, head_dim 128, Hkv = 8, page 16, NHD caches [pages, 16, 8, 128] (contiguous), G <= 8.
// 8 warps; warp w computes kv head w, so each warp's softmax state is a whole (head, split) state
// and there is no cross-warp combine.
//
// Loads: a page's K (or V) for all heads is one contiguous 32 KB slab, read by one cp.async.bulk
// into a ring of NS slab buffers (each completing on its mbarrier; thread 0 issues). A bulk copy
// lands unswizzled, a head's 16 token rows 2 KB apart (an 8-way ldmatrix bank conflict), so each
// warp first copies its head's 16 x 256 B of K and of V into a private swizzled tile (16-byte
// loads of 128 contiguous bytes per 8 lanes, swizzled 16-byte stores: conflict-free both ways),
// and the CTA syncs once per page: then the two slabs are refilled with the page NS / 2 ahead
// while the warps run the tensor-core math of the shipped kernel on their private tiles.
//
// Programmatic dependent launch: the item and page ids are read before griddepcontrol.wait (the
// bench uploads plans before any run), and with `early` bit 1 the first slabs of every page but
// the item's last too (the engine's early_kv contract).
//
// Partial states (o / l, lse in log2 units) per (item, head, g) go to global memory; pg_merge
// combines a row's items per (row, query head). The fused variants (pg_decode_fused4/5) merge
// inside the same grid instead: every CTA publishes its states and arrives on a counter, waits
// until all have arrived (the items are one wave, all CTAs resident: bench_pages refuses a grid
// larger than the SMs), then merges a share of the outputs (units of 32 dims of one (row, query
// head)); the last CTA to leave resets the counters for the next launch.

#include <cuda_fp16.h>

namespace pg {

constexpr int D = 128, HKV = 8, P = 16, WARPS = 8, THREADS = WARPS * 32;
constexpr int SLAB = P * HKV * D * 2;          // bytes of one page's K (or V), all heads
constexpr int TILE_ELEMS = P * D;              // one head's 16 x 128 tile (elements)
constexpr int PRIV_BYTES = WARPS * 2 * TILE_ELEMS * 2;  // bench_pages.PRIVATE
static_assert(PRIV_BYTES == 65536, "bench_pages.py sizes the shared memory with this");
constexpr int NT = D / 8;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ int swz(int t, int c) { return t * D + ((c ^ (t & 7)) << 3); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

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

__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this slot's earlier generic reads first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
      ::"r"(bar), "r"(parity) : "memory");
#endif
}

// One merge unit, the W dims [d0, d0 + W) of one (row, query head): out = sum_s w_s o_s / sum_s w_s
// with w_s = 2^(lse_s - max lse) over the row's items [item_indptr[row], item_indptr[row + 1]).
// MERGE_GROUPS groups of W threads (the CTA); group w takes every MERGE_GROUPS-th item, MERGE_PER
// of them per round with all their loads in flight (a round is ~2 L2 round trips); the groups
// combine through `red` (2 * MERGE_GROUPS + MERGE_GROUPS * W floats of shared memory).
constexpr int MERGE_GROUPS = 8, MERGE_PER = 8;
template <int W>
__device__ void merge_unit(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                           const int* __restrict__ item_indptr, __half* __restrict__ out, int G, int row, int qh,
                           int d0, float* red) {
  const int grp = threadIdx.x / W, lane = threadIdx.x % W;
  float* r_m = red;                             // [MERGE_GROUPS]
  float* r_den = red + MERGE_GROUPS;            // [MERGE_GROUPS]
  float* r_acc = red + 2 * MERGE_GROUPS;        // [MERGE_GROUPS][W]
  const int head = qh / G, g = qh % G, d = d0 + lane;
  const int lo = __ldg(item_indptr + row), hi = __ldg(item_indptr + row + 1);
  float m = NEG_INF, acc = 0.f, den = 0.f;
  for (int base = lo + grp; base < hi; base += MERGE_GROUPS * MERGE_PER) {
    float lse[MERGE_PER], ov[MERGE_PER];
#pragma unroll
    for (int j = 0; j < MERGE_PER; ++j) {
      const int i = base + MERGE_GROUPS * j;
      const long long slot = ((long long)i * HKV + head) * G + g;
      lse[j] = i < hi ? __ldcg(part_lse + slot) : NEG_INF;
      ov[j] = i < hi ? __ldcg(part_o + slot * D + d) : 0.f;
    }
    float mx = m;
#pragma unroll
    for (int j = 0; j < MERGE_PER; ++j) mx = fmaxf(mx, lse[j]);
    if (mx == NEG_INF) continue;
    const float sc = m == NEG_INF ? 0.f : fast_exp2(m - mx);
    acc *= sc;
    den *= sc;
#pragma unroll
    for (int j = 0; j < MERGE_PER; ++j) {
      const float w = lse[j] == NEG_INF ? 0.f : fast_exp2(lse[j] - mx);
      acc += w * ov[j];
      den += w;
    }
    m = mx;
  }
  if (lane == 0) r_m[grp] = m;
  __syncthreads();
  float M = NEG_INF;
#pragma unroll
  for (int j = 0; j < MERGE_GROUPS; ++j) M = fmaxf(M, r_m[j]);
  const float sc = m == NEG_INF ? 0.f : fast_exp2(m - M);
  r_acc[grp * W + lane] = acc * sc;
  if (lane == 0) r_den[grp] = den * sc;
  __syncthreads();
  if (grp == 0) {
    float a = 0.f, s = 0.f;
#pragma unroll
    for (int j = 0; j < MERGE_GROUPS; ++j) {
      a += r_acc[j * W + lane];
      s += r_den[j];
    }
    out[((long long)row * HKV * G + qh) * D + d] = __float2half_rn(s > 0.f ? a / s : 0.f);
  }
  __syncthreads();  // `red` may be reused by the caller's next unit
}

// The fused variants' share of the merge: units of 32 dims, unit u = blockIdx.x + j * gridDim.x
// (u = ((row * Hq + qh) * 4 + the 32-dim chunk), `units` in all), 8 groups of 32 threads each.
__device__ void merge_units(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                            const int* __restrict__ item_indptr, __half* __restrict__ out, int G, int units,
                            float* red) {
  static_assert(MERGE_GROUPS * 32 == THREADS, "merge_units: the decode CTA's threads as 8 groups of 32");
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int qh = (u >> 2) % (HKV * G), row = (u >> 2) / (HKV * G);
    merge_unit<32>(part_o, part_lse, item_indptr, out, G, row, qh, (u & 3) * 32, red);
  }
}

// items[i] = {row, first page, end page, 0} (pages of the row, in block-table order).
template <int NS, bool FUSED>
__device__ void decode(const __half* __restrict__ q, const __half* __restrict__ k, const __half* __restrict__ v,
                       const int* __restrict__ kv_indices, const int* __restrict__ kv_indptr,
                       const int* __restrict__ seq_lens, const int4* __restrict__ items, float* __restrict__ part_o,
                       float* __restrict__ part_lse, int G, float scale_log2, int early, const int* item_indptr,
                       __half* out, int* counters, int units) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[NS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int4 it = items[blockIdx.x];
  const int row = it.x, plo = it.y, npg = it.z - it.y;
  const int len = __ldg(seq_lens + row);
  const int* pages = kv_indices + __ldg(kv_indptr + row) + plo;
  const int t_lo = plo * P, t_hi = min(len, it.z * P);  // this item's tokens
  const int nslabs = 2 * npg;
  unsigned char* ring = smem;
  __half* privK = reinterpret_cast<__half*>(smem + NS * SLAB) + warp * 2 * TILE_ELEMS;
  __half* privV = privK + TILE_ELEMS;

  if (tid == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int s = 0; s < NS; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }
  __syncthreads();
  auto issue = [&](int s) {  // thread 0: slab s (page s / 2, K if even) into ring slot s % NS
    const int page = __ldg(pages + (s >> 1));
    const __half* src = (s & 1 ? v : k) + (long long)page * (SLAB / 2);
    bulk_load(smem_u32(ring + (s % NS) * SLAB), src, SLAB, smem_u32(&bars[s % NS]));
  };
  const int first = min(NS, nslabs);
  const bool kv_early = early & 2;
  if (tid == 0 && kv_early)
    for (int s = 0; s < first; ++s)
      if ((s >> 1) != npg - 1) issue(s);
  grid_wait();
  grid_launch_dependents();
  if (tid == 0)
    for (int s = 0; s < first; ++s)
      if (!kv_early || (s >> 1) == npg - 1) issue(s);

  // Q fragments (A operand: 16 rows = the G query heads of kv head `warp`, zero beyond G).
  unsigned qf[D / 16][4];
  {
    const int g0 = lane >> 2, g1 = g0 + 8, c = (lane & 3) * 2;
    const __half* q0 = q + ((long long)row * HKV * G + warp * G + g0) * D;
    const __half* q1 = q + ((long long)row * HKV * G + warp * G + g1) * D;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][0] = g0 < G ? __ldg(reinterpret_cast<const unsigned*>(q0 + kk * 16 + c)) : 0u;
      qf[kk][1] = g1 < G ? __ldg(reinterpret_cast<const unsigned*>(q1 + kk * 16 + c)) : 0u;
      qf[kk][2] = g0 < G ? __ldg(reinterpret_cast<const unsigned*>(q0 + kk * 16 + 8 + c)) : 0u;
      qf[kk][3] = g1 < G ? __ldg(reinterpret_cast<const unsigned*>(q1 + kk * 16 + 8 + c)) : 0u;
    }
  }

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const int mi = lane >> 3, r = lane & 7;

  for (int i = 0; i < npg; ++i) {
    const int sK = 2 * i, sV = sK + 1;
    bar_wait(smem_u32(&bars[sK % NS]), (sK / NS) & 1);
    bar_wait(smem_u32(&bars[sV % NS]), (sV / NS) & 1);
    const unsigned char* slabK = ring + (sK % NS) * SLAB;
    const unsigned char* slabV = ring + (sV % NS) * SLAB;
    const int tok0 = t_lo + i * P;
    // This warp's head out of both slabs: lanes 0-15 token 2j, lanes 16-31 token 2j + 1, 16 B each.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int t = 2 * j + (lane >> 4), c = lane & 15;
      const int off = t * (HKV * D * 2) + warp * (D * 2) + c * 16;
      const uint4 kv = *reinterpret_cast<const uint4*>(slabK + off);
      uint4 vv = *reinterpret_cast<const uint4*>(slabV + off);
      if (tok0 + t >= t_hi) vv = make_uint4(0u, 0u, 0u, 0u);  // rows past the row's end: 0 x stale bits could be NaN
      *reinterpret_cast<uint4*>(privK + swz(t, c)) = kv;
      *reinterpret_cast<uint4*>(privV + swz(t, c)) = vv;
    }
    __syncthreads();  // every warp is done with both slabs
    if (tid == 0) {
      if (sK + NS < nslabs) issue(sK + NS);
      if (sV + NS < nslabs) issue(sV + NS);
    }
    __syncwarp();

    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int tk = (mi >> 1) * 8 + r;
      unsigned b0, b1, b2, b3;
      ldsm_x4(smem_u32(privK + swz(tk, 2 * kk + (mi & 1))), b0, b1, b2, b3);
      mma16816(s[0], qf[kk], b0, b1);
      mma16816(s[1], qf[kk], b2, b3);
    }
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
        s[j][e] = tok < t_hi ? s[j][e] * scale_log2 : NEG_INF;
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
      const int tv = (mi & 1) * 8 + r;
      unsigned b0, b1, b2, b3;
      ldsm_x4_t(smem_u32(privV + swz(tv, 2 * dp + (mi >> 1))), b0, b1, b2, b3);
      mma16816(o[2 * dp], pa, b0, b1);
      mma16816(o[2 * dp + 1], pa, b2, b3);
    }
    __syncwarp();  // the next page's copy overwrites this warp's tiles
  }

  // This warp's (head, split) state: rows g0 = lane / 4 (and g1 = g0 + 8 when G > 8, not here).
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  const int g0 = lane >> 2;
  if (g0 < G) {
    const float inv = l0 > 0.f ? 1.f / l0 : 0.f;
    const long long slot = ((long long)blockIdx.x * HKV + warp) * G + g0;
    const int c = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < NT; ++j)
      *reinterpret_cast<float2*>(part_o + slot * D + j * 8 + c) = make_float2(o[j][0] * inv, o[j][1] * inv);
    if ((lane & 3) == 0) part_lse[slot] = l0 > 0.f ? m0 + __log2f(l0) : NEG_INF;
  }
  if constexpr (FUSED) {
    // Grid-wide: after the barrier one thread's release increment publishes the CTA's states
    // (cumulative over what the barrier ordered), its acquire loads see every CTA's once all have
    // arrived, and the barrier after extends that to the CTA; the merge reads go to L2 (.cg).
    __shared__ float red[2 * MERGE_GROUPS + MERGE_GROUPS * 32];
    __syncthreads();
    if (tid == 0) {
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counters) : "memory");
      int seen = 0;
      unsigned spins = 0;
      do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counters) : "memory");
        if (++spins > (1u << 28)) __trap();  // CTAs that never became resident: an error, not a hang
      } while (seen < (int)gridDim.x);
    }
    __syncthreads();
    merge_units(part_o, part_lse, item_indptr, out, G, units, red);
    if (tid == 0) {  // the last CTA out resets both counters (every CTA has read counters[0] by then)
      int prev;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counters + 1) : "memory");
      if (prev == (int)gridDim.x - 1) {
        counters[0] = 0;
        counters[1] = 0;
      }
    }
  }
}

}  // namespace pg

// item_indptr, out, counters and units are read by the fused variants only.
#define PG_ARGS                                                                                          \
  const __half *q, const __half *k, const __half *v, const int *kv_indices, const int *kv_indptr,        \
      const int *seq_lens, const int4 *items, float *part_o, float *part_lse, int G, float scale_log2,   \
      int early, const int *item_indptr, __half *out, int *counters, int units
#define PG_PASS q, k, v, kv_indices, kv_indptr, seq_lens, items, part_o, part_lse, G, scale_log2, early, \
                item_indptr, out, counters, units

extern "C" __global__ void __launch_bounds__(pg::THREADS, 1) pg_decode4(PG_ARGS) { pg::decode<4, false>(PG_PASS); }
extern "C" __global__ void __launch_bounds__(pg::THREADS, 1) pg_decode5(PG_ARGS) { pg::decode<5, false>(PG_PASS); }
extern "C" __global__ void __launch_bounds__(pg::THREADS, 1) pg_decode_fused4(PG_ARGS) { pg::decode<4, true>(PG_PASS); }
extern "C" __global__ void __launch_bounds__(pg::THREADS, 1) pg_decode_fused5(PG_ARGS) { pg::decode<5, true>(PG_PASS); }

// One CTA per (row, query head): merge_unit over all 128 dims, 1024 threads (8 groups of 128).
extern "C" __global__ void __launch_bounds__(pg::MERGE_GROUPS * pg::D) pg_merge(const float* __restrict__ part_o,
                                                                                const float* __restrict__ part_lse,
                                                                                const int* __restrict__ item_indptr,
                                                                                __half* __restrict__ out, int G) {
  __shared__ float red[2 * pg::MERGE_GROUPS + pg::MERGE_GROUPS * pg::D];
  pg::grid_wait();
  pg::grid_launch_dependents();
  pg::merge_unit<pg::D>(part_o, part_lse, item_indptr, out, G, blockIdx.x / (pg::HKV * G),
                        blockIdx.x % (pg::HKV * G), 0, red);
}
