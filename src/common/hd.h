// FC_HD marks a function that host code and device code share (everything under src/common):
// __host__ __device__ and forced inline under nvcc, plain inline in C++.
#pragma once

#if defined(__CUDACC__)
#define FC_HD __host__ __device__ __forceinline__
#else
#define FC_HD inline
#endif
