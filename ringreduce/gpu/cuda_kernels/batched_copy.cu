// Many small copies in one launch: packing a bucket's gradients into its flat buffer, or
// unpacking them. Row y of the grid copies counts[y] elements from sources[y] to targets[y];
// the pointer table lives in device memory. One kernel per element size, so loads are whole
// elements rather than bytes.

#define BATCHED_COPY(BYTES, T)                                                                \
extern "C" __global__ void batched_copy_##BYTES(const unsigned long long* sources,           \
                                                const unsigned long long* targets,           \
                                                const long long* counts) {                   \
    const T* source = (const T*)sources[blockIdx.y];                                          \
    T* target = (T*)targets[blockIdx.y];                                                      \
    long long n = counts[blockIdx.y];                                                         \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;               \
         i += (long long)blockDim.x * gridDim.x)                                              \
        target[i] = source[i];                                                                \
}

BATCHED_COPY(1, unsigned char)
BATCHED_COPY(2, unsigned short)
BATCHED_COPY(4, unsigned int)
BATCHED_COPY(8, unsigned long long)
