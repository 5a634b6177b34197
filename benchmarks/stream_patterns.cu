// Development kernels for benchmarks/bench_stream.py: ways one kernel call can stream B bytes it
// only reads, at a decode step's sizes (16-537 MB). The question they answer: is the plain read
// of kernels/ceiling.cu (grid-stride, four 16-byte loads in flight per thread, 8 CTAs per SM, no
// programmatic dependent launch) the fastest a short step can stream, or do contiguous per-CTA
// chunks, more bytes in flight, Hopper's bulk copies (cp.async.bulk into shared memory, completed
// on an mbarrier) or PDL ramp up and drain faster? Not shipped: nothing in src/ loads this file.
//
// Every kernel XOR-folds each 32-bit word it read into *sink (one atomicXor per warp), so the
// bench can check each variant read every byte exactly once (the XOR of the whole buffer).
// pdl != 0: griddepcontrol.wait before the first load (a consumer of the previous call's output
// must wait there), then griddepcontrol.launch_dependents, as pkv_decode does.

typedef unsigned long long u64;

__device__ __forceinline__ void pdl_begin(int pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
#endif
}

__device__ __forceinline__ unsigned fold4(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ void publish(unsigned acc, unsigned* sink) {
  for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31u) == 0u) atomicXor(sink, acc);
}

// 16-byte read-only load that does not allocate in L1 and asks L2 to fetch the 256-byte sector
// group around it.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The read-ceiling pattern (kernels/ceiling.cu), with optional PDL.
extern "C" __global__ void __launch_bounds__(256) st_grid(const uint4* __restrict__ src, u64 n_vec,
                                                          unsigned* __restrict__ sink, int pdl) {
  pdl_begin(pdl);
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned acc = 0u;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    const uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
                d = __ldg(src + i + 3 * stride);
    acc ^= fold4(a) ^ fold4(b) ^ fold4(c) ^ fold4(d);
  }
  for (; i < n_vec; i += stride) acc ^= fold4(__ldg(src + i));
  publish(acc, sink);
}

// Contiguous chunk per CTA (as a decode item is), U 16-byte loads in flight per thread.
template <int U, bool HINT>
__device__ __forceinline__ void chunk_body(const uint4* __restrict__ src, u64 n_vec, unsigned* __restrict__ sink) {
  const u64 per = (n_vec + gridDim.x - 1) / gridDim.x;
  const u64 lo = static_cast<u64>(blockIdx.x) * per;
  const u64 hi = lo + per < n_vec ? lo + per : n_vec;
  const u64 step = blockDim.x;
  unsigned acc = 0u;
  u64 i = lo + threadIdx.x;
  for (; i + (U - 1) * step < hi; i += U * step) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = HINT ? ld_stream(src + i + u * step) : __ldg(src + i + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold4(v[u]);
  }
  for (; i < hi; i += step) acc ^= fold4(__ldg(src + i));
  publish(acc, sink);
}

extern "C" __global__ void __launch_bounds__(1024) st_chunk8(const uint4* __restrict__ src, u64 n_vec,
                                                             unsigned* __restrict__ sink, int pdl) {
  pdl_begin(pdl);
  chunk_body<8, false>(src, n_vec, sink);
}

extern "C" __global__ void __launch_bounds__(1024) st_chunk8_l2(const uint4* __restrict__ src, u64 n_vec,
                                                                unsigned* __restrict__ sink, int pdl) {
  pdl_begin(pdl);
  chunk_body<8, true>(src, n_vec, sink);
}

// Bulk copies: a contiguous chunk per CTA streamed through `stages` shared-memory buffers of
// `chunk` bytes, each filled by one cp.async.bulk that completes on the buffer's mbarrier
// (expect_tx by the issuing thread); every thread then reads the buffer (as a decode CTA reads
// its K/V tiles), the CTA syncs and thread 0 refills it with the chunk `stages` ahead.
#define MAX_STAGES 16

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bulk_issue(const unsigned char* src, unsigned bytes, unsigned dst, unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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

// Thread 0 initialises `stages` mbarriers of one arrival each and makes them visible to the async
// proxy; the CTA syncs.
__device__ __forceinline__ void init_bars(u64* bars, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
#endif
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256) st_bulk(const unsigned char* __restrict__ src, u64 nbytes,
                                                          unsigned* __restrict__ sink, int pdl, int stages,
                                                          int chunk) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) u64 bars[MAX_STAGES];
  const u64 per = ((nbytes + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
  const u64 lo = static_cast<u64>(blockIdx.x) * per < nbytes ? static_cast<u64>(blockIdx.x) * per : nbytes;
  const u64 hi = lo + per < nbytes ? lo + per : nbytes;
  const int n_chunks = static_cast<int>((hi - lo + chunk - 1) / chunk);
  init_bars(bars, stages);
  pdl_begin(pdl);
  if (threadIdx.x == 0) {
    for (int c = 0; c < stages && c < n_chunks; ++c) {
      const u64 off = lo + static_cast<u64>(c) * chunk;
      const unsigned bytes = static_cast<unsigned>(hi - off < static_cast<u64>(chunk) ? hi - off : chunk);
      bulk_issue(src + off, bytes, smem_u32(buf + c * chunk), smem_u32(&bars[c]));
    }
  }
  unsigned acc = 0u;
  for (int c = 0; c < n_chunks; ++c) {
    const int s = c % stages;
    bar_wait(smem_u32(&bars[s]), static_cast<unsigned>((c / stages) & 1));
    const u64 off = lo + static_cast<u64>(c) * chunk;
    const unsigned bytes = static_cast<unsigned>(hi - off < static_cast<u64>(chunk) ? hi - off : chunk);
    const uint4* b = reinterpret_cast<const uint4*>(buf + s * chunk);
    for (unsigned j = threadIdx.x; j < bytes / 16; j += blockDim.x) acc ^= fold4(b[j]);
    __syncthreads();
    if (threadIdx.x == 0 && c + stages < n_chunks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // our reads before the async refill
#endif
      const u64 noff = lo + static_cast<u64>(c + stages) * chunk;
      const unsigned nbytes_c = static_cast<unsigned>(hi - noff < static_cast<u64>(chunk) ? hi - noff : chunk);
      bulk_issue(src + noff, nbytes_c, smem_u32(buf + s * chunk), smem_u32(&bars[s]));
    }
  }
  publish(acc, sink);
}

// Paged variants: one row's pages of a K and a V cache [pages, 16, 8, 128] fp16 (32 KB per page),
// in block-table order (scattered page ids). Each CTA streams a contiguous range of the row's
// pages, K slab then V slab per page, through `stages` shared buffers of 32 KB.
//   st_pages_bulk: one cp.async.bulk per slab (a page's K or V for all kv heads is contiguous)
//   st_pages_tma:  two tensor-map boxes per slab (64 dims x 16 tokens x 8 heads = 16 KB each,
//                  128-byte swizzle) of a map whose dims are (dim, token, head, page): the layout a
//                  kernel that owns all kv heads of a token range would want ([head][token][64])
struct __align__(128) TMap128 {
  unsigned long long v[16];
};

__device__ __forceinline__ void slab_range(int npages, int& lo, int& hi) {
  const int per = (npages + gridDim.x - 1) / gridDim.x;
  lo = min(npages, static_cast<int>(blockIdx.x) * per);
  hi = min(npages, lo + per);
}

__device__ __forceinline__ unsigned consume(const unsigned char* buf, unsigned bytes) {
  unsigned acc = 0u;
  const uint4* b = reinterpret_cast<const uint4*>(buf);
  for (unsigned j = threadIdx.x; j < bytes / 16; j += blockDim.x) acc ^= fold4(b[j]);
  return acc;
}

template <bool TMA>
__device__ __forceinline__ void pages_body(const unsigned char* __restrict__ k, const unsigned char* __restrict__ v,
                                           const int* __restrict__ pages, int npages, unsigned* __restrict__ sink,
                                           int pdl, int stages, const void* tmk, const void* tmv) {
  constexpr unsigned SLAB = 32768;
  extern __shared__ __align__(1024) unsigned char slab_buf[];  // st_bulk's `buf` is declared 128-aligned
  __shared__ __align__(8) u64 bars[MAX_STAGES];
  unsigned char* base = slab_buf + ((1024u - (smem_u32(slab_buf) & 1023u)) & 1023u);
  int lo, hi;
  slab_range(npages, lo, hi);
  const int n = 2 * (hi - lo);  // slabs: K, V of each page
  init_bars(bars, stages);
  pdl_begin(pdl);
  auto issue = [&](int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int s = c % stages;
    const int page = __ldg(pages + lo + c / 2);
    const unsigned dst = smem_u32(base + static_cast<u64>(s) * SLAB), bar = smem_u32(&bars[s]);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (!TMA) {
      bulk_issue((c & 1 ? v : k) + static_cast<u64>(page) * SLAB, SLAB, dst, bar);
    } else {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(SLAB) : "memory");
      const void* map = c & 1 ? tmv : tmk;
      for (int h = 0; h < 2; ++h)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
            ::"r"(dst + h * (SLAB / 2)), "l"(map), "r"(h * 64), "r"(0), "r"(0), "r"(page), "r"(bar) : "memory");
    }
#endif
  };
  if (threadIdx.x == 0)
    for (int c = 0; c < stages && c < n; ++c) issue(c);
  unsigned acc = 0u;
  for (int c = 0; c < n; ++c) {
    const int s = c % stages;
    bar_wait(smem_u32(&bars[s]), static_cast<unsigned>((c / stages) & 1));
    acc ^= consume(base + static_cast<u64>(s) * SLAB, SLAB);
    __syncthreads();
    if (threadIdx.x == 0 && c + stages < n) issue(c + stages);
  }
  publish(acc, sink);
}

extern "C" __global__ void __launch_bounds__(256) st_pages_bulk(const unsigned char* __restrict__ k,
                                                                const unsigned char* __restrict__ v,
                                                                const int* __restrict__ pages, int npages,
                                                                unsigned* __restrict__ sink, int pdl, int stages) {
  pages_body<false>(k, v, pages, npages, sink, pdl, stages, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) st_pages_tma(const unsigned char* __restrict__ k,
                                                               const unsigned char* __restrict__ v,
                                                               const int* __restrict__ pages, int npages,
                                                               unsigned* __restrict__ sink, int pdl, int stages,
                                                               const __grid_constant__ TMap128 tmk,
                                                               const __grid_constant__ TMap128 tmv) {
  pages_body<true>(k, v, pages, npages, sink, pdl, stages, &tmk, &tmv);
}

// Per-thread 16-byte loads over a page range, but only K kv heads of each token row (K x 256 B
// contiguous of the row's 2 KB, the rest read by other CTAs): the pieces a CTA that owns K kv
// heads of its tokens reads (pkv_decode's items own one, K = 1). 8 / K head groups x page ranges;
// head_fast: consecutive CTAs take the head groups of one page range (else the page ranges of one
// head group, the queue's item order). gridDim.x must be a multiple of 8 / K.
template <int K>
__device__ __forceinline__ void pages_heads_body(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                 const int* __restrict__ pages, int npages,
                                                 unsigned* __restrict__ sink, int pdl, int head_fast) {
  pdl_begin(pdl);
  constexpr int GROUPS = 8 / K, PIECE = K * 16, PER_SLAB = 16 * PIECE;  // uint4 of one token's group; of a slab
  const int ranges = gridDim.x / GROUPS;
  const int g = head_fast ? blockIdx.x % GROUPS : blockIdx.x / ranges;
  const int r = head_fast ? blockIdx.x / GROUPS : blockIdx.x % ranges;
  const int per = (npages + ranges - 1) / ranges;
  const int lo = min(npages, r * per), hi = min(npages, lo + per);
  unsigned acc = 0u;
  const int total = 2 * (hi - lo) * PER_SLAB;
  for (int i0 = threadIdx.x; i0 < total; i0 += 8 * blockDim.x) {
    uint4 x[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total) {
        const int slab = i / PER_SLAB, off = i - slab * PER_SLAB;
        const int tok = off / PIECE, w = off - tok * PIECE;
        const int page = __ldg(pages + lo + slab / 2);
        x[u] = __ldg((slab & 1 ? v : k) + static_cast<u64>(page) * 2048 + tok * 128 + g * PIECE + w);
      } else {
        x[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= fold4(x[u]);
  }
  publish(acc, sink);
}

// Per-thread 16-byte loads over the row's slabs (8 in flight per thread), CTA = page range: the
// heads body above with all 8 kv heads per CTA (one head group, so the CTA order does not matter).
extern "C" __global__ void __launch_bounds__(1024) st_pages_loads(const uint4* __restrict__ k,
                                                                  const uint4* __restrict__ v,
                                                                  const int* __restrict__ pages, int npages,
                                                                  unsigned* __restrict__ sink, int pdl) {
  pages_heads_body<8>(k, v, pages, npages, sink, pdl, 1);
}

#define ST_PAGES_HEADS(K)                                                                                       \
  extern "C" __global__ void __launch_bounds__(1024) st_pages_h##K(const uint4* __restrict__ k,                 \
                                                                   const uint4* __restrict__ v,                 \
                                                                   const int* __restrict__ pages, int npages,   \
                                                                   unsigned* __restrict__ sink, int pdl,        \
                                                                   int head_fast) {                             \
    pages_heads_body<K>(k, v, pages, npages, sink, pdl, head_fast);                                             \
  }
ST_PAGES_HEADS(1)
ST_PAGES_HEADS(2)
ST_PAGES_HEADS(4)
ST_PAGES_HEADS(8)
