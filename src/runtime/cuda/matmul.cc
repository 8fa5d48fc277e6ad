#include "runtime/cuda/matmul.h"

#include <sstream>

#include "runtime/cuda/cuda_check.h"

namespace tally::runtime::cuda {

namespace {


cudaDataType_t cuda_type(const Tensor& t, const char* what) {
  switch (t.dtype()) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: TALLY_FAIL("matmul on CUDA: ", what, " ", t.str(), " must be float32 or bfloat16");
  }
}

// A 2-D view as row-major storage: `rows` x `cols` with row stride `ld`, and whether the
// view is the transpose of that storage (its columns are contiguous).
struct RowMajor {
  const void* data;
  int64_t rows, cols, ld;
  bool transposed;
};
RowMajor as_row_major(const Tensor& x, const char* what) {
  TALLY_CHECK(x.dim() == 2, "matmul on CUDA: ", what, " ", x.str(), " must be 2-D");
  const int64_t r = x.shape()[0], c = x.shape()[1], s0 = x.strides()[0], s1 = x.strides()[1];
  if (s1 == 1 || c == 1) return {x.raw_data(), r, c, std::max<int64_t>({s0, c, 1}), false};
  if (s0 == 1 || r == 1) return {x.raw_data(), c, r, std::max<int64_t>({s1, r, 1}), true};
  TALLY_FAIL("matmul on CUDA: ", what, " ", x.str(), " has neither contiguous rows nor contiguous columns (strides ",
             s0, ", ", s1, ")");
}

}  // namespace

// A chosen algorithm with its descriptors, kept for every shape seen (a training step
// repeats the same few dozen shapes).
struct Matmul::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  ~Plan() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

Matmul::Matmul(Device device) : device_(device) {
  TALLY_CUBLAS_CHECK(cublasLtCreate(&handle_));
  OwnerTag tag = make_owner(Category::Other, "cublaslt.workspace");
  tag.persistent = true;
  workspace_ = Tensor::empty({kMatmulWorkspaceBytes / 2}, DType::U16, device, tag);  // raw bytes, held as 2-byte values
}

Matmul::~Matmul() {
  for (auto& [key, plan] : plans_) delete plan;
  if (handle_) cublasLtDestroy(handle_);
}

bool Matmul::run(cudaStream_t stream, const Tensor& a_in, bool ta, const Tensor& b_in, bool tb, const Tensor& c_in,
                 float alpha, float beta, const Tensor& bias) {
  TALLY_CHECK(c_in.dim() == 2, "matmul on CUDA: output ", c_in.str(), " must be 2-D");
  const int64_t m = c_in.shape()[0], n = c_in.shape()[1];
  const int64_t k = ta ? a_in.shape()[0] : a_in.shape()[1];
  TALLY_CHECK((ta ? a_in.shape()[1] : a_in.shape()[0]) == m && (tb ? b_in.shape()[1] : b_in.shape()[0]) == k &&
                  (tb ? b_in.shape()[0] : b_in.shape()[1]) == n,
              "matmul on CUDA: shapes ", a_in.str(), (ta ? "^T" : ""), " x ", b_in.str(), (tb ? "^T" : ""), " -> ",
              c_in.str(), " do not match");
  if (m == 0 || n == 0) return true;
  // C with contiguous columns: compute C^T = op(B)^T op(A)^T, whose rows are contiguous.
  if (c_in.strides()[1] != 1 && n > 1) {
    TALLY_CHECK(!bias.defined(), "matmul on CUDA: a bias needs an output with contiguous rows, got ", c_in.str());
    return run(stream, b_in, !tb, a_in, !ta, c_in.transpose(0, 1), alpha, beta);
  }
  const RowMajor A = as_row_major(a_in, "A"), B = as_row_major(b_in, "B");
  const bool opa = ta != A.transposed, opb = tb != B.transposed;
  const int64_t ldc = std::max<int64_t>({c_in.strides()[0], n, 1});
  const cudaDataType_t at = cuda_type(a_in, "A"), bt = cuda_type(b_in, "B"), ct = cuda_type(c_in, "C");
  TALLY_CHECK(at == bt, "matmul on CUDA: A ", a_in.str(), " and B ", b_in.str(), " differ in dtype");
  TALLY_CHECK(at == CUDA_R_16BF || ct == CUDA_R_32F, "matmul on CUDA: float32 operands need a float32 output, got ",
              c_in.str());
  const cudaDataType_t bias_t = bias.defined() ? cuda_type(bias, "bias") : CUDA_R_32F;

  // Row-major C (m x n) is column-major C^T (n x m): C^T = op(B)^T op(A)^T, so cuBLASLt's
  // first operand is B's storage read column-major (cols x rows), its second A's.
  // The heuristic assumes 256-byte aligned operands unless told otherwise, and an algorithm
  // it picks for those may refuse (CUBLAS_STATUS_NOT_SUPPORTED) operands that are less
  // aligned, as a parameter's view inside the flat block can be: each operand's alignment
  // (the largest power of two up to 256 dividing its address) is part of the plan.
  auto alignment = [](const void* p) -> uint32_t {
    const auto address = reinterpret_cast<uintptr_t>(p);
    uint32_t a = 256;
    while (a > 1 && address % a != 0) a /= 2;
    return a;
  };
  const uint32_t align_a = alignment(B.data), align_b = alignment(A.data), align_c = alignment(c_in.raw_data());
  std::ostringstream key;
  key << m << ',' << n << ',' << k << ',' << opa << opb << ',' << A.ld << ',' << B.ld << ',' << ldc << ',' << at << ','
      << ct << ',' << (bias.defined() ? static_cast<int>(bias_t) : -1) << ',' << (beta != 0.f) << ',' << align_a << ','
      << align_b << ',' << align_c;
  Plan*& plan = plans_[key.str()];
  if (!plan) {
    plan = new Plan();
    TALLY_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t first = opb ? CUBLAS_OP_T : CUBLAS_OP_N, second = opa ? CUBLAS_OP_T : CUBLAS_OP_N;
    TALLY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &first, sizeof(first)));
    TALLY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &second, sizeof(second)));
    if (bias.defined()) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      TALLY_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
      TALLY_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_t, sizeof(bias_t)));
    }
    // Stored (rows x cols) row-major = (cols x rows) column-major with the same ld.
    TALLY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, bt, B.cols, B.rows, B.ld));
    TALLY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, at, A.cols, A.rows, A.ld));
    TALLY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, ct, n, m, ldc));
    cublasLtMatmulPreference_t pref;
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kMatmulWorkspaceBytes;
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    // cuBLASLt's first operand is B's storage, its second A's (see above); C is also D.
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                            sizeof(align_a)));
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                            sizeof(align_b)));
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                            sizeof(align_c)));
    TALLY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                            sizeof(align_c)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, plan->op, plan->a, plan->b, plan->c, plan->c,
                                                             pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    plan->found = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (plan->found) plan->algo = result.algo;
    else
      TALLY_CHECK(bias.defined(), "matmul on CUDA: cuBLASLt has no algorithm for ", a_in.str(), (ta ? "^T" : ""),
                  " x ", b_in.str(), (tb ? "^T" : ""), " -> ", c_in.str(), " (status ", static_cast<int>(st), ")");
  }
  if (!plan->found) return false;
  if (bias.defined()) {
    const void* bias_ptr = bias.raw_data();
    TALLY_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)));
  }
  TALLY_CUBLAS_CHECK(cublasLtMatmul(handle_, plan->op, &alpha, B.data, plan->a, A.data, plan->b, &beta, c_in.raw_data(),
                                    plan->c, c_in.raw_data(), plan->c, &plan->algo, workspace_.raw_data(),
                                    kMatmulWorkspaceBytes, stream));
  return true;
}

}  // namespace tally::runtime::cuda
