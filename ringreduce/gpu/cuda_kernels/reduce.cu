// Our reductions on the device, as the CPU kernels (native/kernels.c) compute them: the step of
// the CUDA-aware ring on 16-bit floats held as unsigned short storage (CuPy has no bfloat16)
// and their scaling (NAME_reduce, NAME_scale), and the GPU node way's reduction from every
// rank's memory on the node (peer_reduce_*). The 16-bit floats are widened to float, combined
// and rounded back to nearest even once per step, as torch computes them; integer sums and
// products wrap around; Min and Max propagate NaN. No headers at all: device_kernels.py
// compiles this with the op codes of native/constants.h as -D options (kernel_options(), from
// ringreduce.ReduceOp, whose values the C extension was built with), so the installed package
// needs nothing but this file.
#if !defined(RR_OP_MIN) || !defined(RR_OP_MAX) || !defined(RR_OP_PRODUCT)
#error "compile with ringreduce.gpu.device_kernels.kernel_options(): the RR_OP_* codes come as -D options"
#endif

__device__ float bf16_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ unsigned short float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;    // NaN, as torch
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ float fp16_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ unsigned short float_to_fp16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// As native/kernels.c: the first operand where it is smaller (larger), or NaN; else the second.
#define MINIMUM(p, q) (((p) < (q) || (p) != (p)) ? (p) : (q))
#define MAXIMUM(p, q) (((p) > (q) || (p) != (p)) ? (p) : (q))

#define FLOAT_COMBINE(NAME, T)                                                                \
__device__ T NAME(T p, T q, int op) {                                                         \
    if (op == RR_OP_MIN) return MINIMUM(p, q);                                                \
    if (op == RR_OP_MAX) return MAXIMUM(p, q);                                                \
    return op == RR_OP_PRODUCT ? p * q : p + q;                                               \
}

FLOAT_COMBINE(combine, float)
FLOAT_COMBINE(combine_f64, double)

// W: an unsigned type wide enough that sums and products wrap instead of overflowing.
#define INTEGER_COMBINE(NAME, T, W)                                                           \
__device__ T NAME(T p, T q, int op) {                                                         \
    if (op == RR_OP_MIN) return MINIMUM(p, q);                                                \
    if (op == RR_OP_MAX) return MAXIMUM(p, q);                                                \
    return op == RR_OP_PRODUCT ? (T)((W)p * (W)q) : (T)((W)p + (W)q);                         \
}

INTEGER_COMBINE(combine_u8, unsigned char, unsigned int)
INTEGER_COMBINE(combine_i8, signed char, unsigned int)
INTEGER_COMBINE(combine_i16, short, unsigned int)
INTEGER_COMBINE(combine_i32, int, unsigned int)
INTEGER_COMBINE(combine_i64, long long, unsigned long long)

__device__ unsigned short combine_bf16(unsigned short p, unsigned short q, int op) {
    return float_to_bf16(combine(bf16_to_float(p), bf16_to_float(q), op));
}

__device__ unsigned short combine_fp16(unsigned short p, unsigned short q, int op) {
    return float_to_fp16(combine(fp16_to_float(p), fp16_to_float(q), op));
}

#define HALF_KERNELS(NAME, TO_FLOAT, FROM_FLOAT)                                              \
extern "C" __global__ void NAME##_reduce(unsigned short* target, const unsigned short* source, \
                                         long long n, int op) {                              \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x)                                              \
        target[i] = combine_##NAME(target[i], source[i], op);                                 \
}                                                                                             \
extern "C" __global__ void NAME##_scale(unsigned short* x, long long n, float factor) {       \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x)                                              \
        x[i] = FROM_FLOAT(TO_FLOAT(x[i]) * factor);                                           \
}

HALF_KERNELS(bf16, bf16_to_float, float_to_bf16)
HALF_KERNELS(fp16, fp16_to_float, float_to_fp16)

// The node way's reduction: out[i] = in_0[offset + i] op in_1[offset + i] op ... op
// in_{ranks-1}[offset + i], in rank order, each step rounded to T as the CPU's node way rounds
// it, so that every rank computes the same bits. `inputs` is a table in device memory of each
// rank's block (its own, and the peers' opened through CUDA IPC). `out` may be one of the
// inputs at `offset` (an element is read from every rank before it is written).
#define PEER_REDUCE(NAME, T)                                                                  \
extern "C" __global__ void peer_reduce_##NAME(const unsigned long long* inputs, int ranks,    \
                                              long long offset, T* out, long long n, int op) { \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x) {                                            \
        T acc = ((const T*)inputs[0])[offset + i];                                            \
        for (int r = 1; r < ranks; r++)                                                       \
            acc = combine_##NAME(acc, ((const T*)inputs[r])[offset + i], op);                 \
        out[i] = acc;                                                                         \
    }                                                                                         \
}

#define combine_f32 combine
PEER_REDUCE(u8, unsigned char)
PEER_REDUCE(i8, signed char)
PEER_REDUCE(i16, short)
PEER_REDUCE(i32, int)
PEER_REDUCE(i64, long long)
PEER_REDUCE(fp16, unsigned short)
PEER_REDUCE(bf16, unsigned short)
PEER_REDUCE(f32, float)
PEER_REDUCE(f64, double)
