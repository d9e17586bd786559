// hd.h: GPU_HD marks a function that both compilers build: nvcc for host and device, the C compiler
// for the host (tests/test_gpu_host.c tests the kernels' own arithmetic and geometry that way).
#pragma once
#ifdef __CUDACC__
#define GPU_HD static inline __host__ __device__
#else
#define GPU_HD static inline
#endif
