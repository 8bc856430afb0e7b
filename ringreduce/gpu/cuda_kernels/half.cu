// Reduction and scaling of 16-bit floats held as unsigned short storage (CuPy has no bfloat16).
// Each value is widened to float, combined, and rounded back once to nearest even, as torch
// computes these dtypes. No headers at all: cuda.py compiles this with the op codes of
// native/constants.h as -D options (kernel_options(), from ringreduce.ReduceOp, whose values
// the C extension was built with), so the installed package needs nothing but this file.
#if !defined(RR_OP_MIN) || !defined(RR_OP_MAX) || !defined(RR_OP_PRODUCT)
#error "compile with ringreduce.gpu.device_kernels.kernel_options(): the RR_OP_* codes come as -D options"
#endif

__device__ float bf16_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ unsigned short float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // quiet NaN
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

__device__ float combine(float a, float b, int op) {
    if (op == RR_OP_MIN || op == RR_OP_MAX) {   // propagate NaN, as torch.minimum does
        if (a != a) return a;
        if (b != b) return b;
        return op == RR_OP_MIN ? fminf(a, b) : fmaxf(a, b);
    }
    return op == RR_OP_PRODUCT ? a * b : a + b;
}

#define HALF_KERNELS(NAME, TO_FLOAT, FROM_FLOAT)                                              \
extern "C" __global__ void NAME##_reduce(unsigned short* target, const unsigned short* source, \
                                         long long n, int op) {                              \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x)                                              \
        target[i] = FROM_FLOAT(combine(TO_FLOAT(target[i]), TO_FLOAT(source[i]), op));        \
}                                                                                             \
extern "C" __global__ void NAME##_scale(unsigned short* x, long long n, float factor) {       \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x)                                              \
        x[i] = FROM_FLOAT(TO_FLOAT(x[i]) * factor);                                           \
}

HALF_KERNELS(bf16, bf16_to_float, float_to_bf16)
HALF_KERNELS(fp16, fp16_to_float, float_to_fp16)
