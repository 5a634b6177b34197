// Read ceiling: how fast this GPU can stream bytes it only reads (no decisions, no writes but one
// word per warp). Every thread walks the buffer with a grid-stride loop of 16-byte loads, four in
// flight per iteration, and XOR-folds what it read; warps reduce with shuffles and one lane per
// warp XORs into *sink, so the compiler cannot drop a single load.
//
// Napkin math (H200): 132 SMs x 2048 threads x 4 loads x 16 B = 17 MB in flight, enough to cover
// HBM3e latency at ~4.5 TB/s (Little's law: 4.5 TB/s x ~1.5 us = 6.8 MB).

// Plain C types only, so NVRTC (CuPy RawModule) compiles it without standard headers.

extern "C" __global__ void __launch_bounds__(256)
read_ceiling(const uint4* __restrict__ src, unsigned long long n_vec, unsigned int* __restrict__ sink) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned int acc = 0u;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    const uint4 a = __ldg(src + i);
    const uint4 b = __ldg(src + i + stride);
    const uint4 c = __ldg(src + i + 2 * stride);
    const uint4 d = __ldg(src + i + 3 * stride);
    acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^ (d.x ^ d.y ^ d.z ^ d.w);
  }
  for (; i < n_vec; i += stride) {
    const uint4 a = __ldg(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  if ((threadIdx.x & 31u) == 0u) {
    atomicXor(sink, acc);
  }
}
