// GEMMs on CUDA through cuBLASLt: C = alpha op(A) op(B) + beta C (+ a bias in every row)
// for 2-D strided views whose rows or columns are contiguous; fp32 operands with fp32
// arithmetic (no TF32, as PyTorch's default), bf16 operands with fp32 accumulation and an
// fp32 or bf16 C. One per device: it owns the cuBLASLt handle, the workspace and the
// cache of chosen algorithms.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <string>

#include "core/tensor.h"
#include "runtime/backend.h"

namespace tally::runtime::cuda {

// cuBLASLt's workspace (runtime/backend.h says its size where no GPU is).
inline constexpr int64_t kMatmulWorkspaceBytes = kCudaMatmulWorkspaceBytes;

class Matmul {
 public:
  explicit Matmul(Device device);
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Returns false (having done nothing) when cuBLASLt has no algorithm for this bias
  // epilogue; the caller then adds the bias itself.
  bool run(cudaStream_t stream, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
           float alpha, float beta, const Tensor& bias = Tensor());

 private:
  struct Plan;
  Device device_;
  cublasLtHandle_t handle_ = nullptr;
  Tensor workspace_;  // device memory owned by this GEMM engine (its ledger entry names it)
  std::map<std::string, Plan*> plans_;
};

}  // namespace tally::runtime::cuda
