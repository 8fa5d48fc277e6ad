// Error checks for CUDA runtime and cuBLASLt calls: a failed call throws with the call's
// text, the file and line, and CUDA's own message, so an error names what failed.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define TALLY_CUDA_CHECK(call)                                                                            \
  do {                                                                                                    \
    const cudaError_t tally_cuda_status = (call);                                                         \
    TALLY_CHECK(tally_cuda_status == cudaSuccess, "CUDA: ", #call, " failed: ", cudaGetErrorString(tally_cuda_status), \
                " (", __FILE__, ":", __LINE__, ")");                                                      \
  } while (0)

// After a kernel launch: a bad configuration shows up here, naming the kernel, not at the
// next call.
#define TALLY_CUDA_LAUNCHED(kernel)                                                                       \
  do {                                                                                                    \
    const cudaError_t tally_launch_status = cudaGetLastError();                                           \
    TALLY_CHECK(tally_launch_status == cudaSuccess, "CUDA: launching ", #kernel, " failed: ",             \
                cudaGetErrorString(tally_launch_status), " (", __FILE__, ":", __LINE__, ")");             \
  } while (0)

#define TALLY_CUBLAS_CHECK(call)                                                                        \
  do {                                                                                                  \
    const cublasStatus_t tally_cublas_status = (call);                                                  \
    TALLY_CHECK(tally_cublas_status == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", #call, " failed with status ", \
                static_cast<int>(tally_cublas_status), " (", cublasLtGetStatusString(tally_cublas_status), ")"); \
  } while (0)
