// Shared test helpers: fixture loading, tensor comparison, finite-difference gradcheck.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "nn/transformer.h"
#include "train/trainer.h"

namespace tally::test {

std::string fixture_path(const std::string& name);  // tests/fixtures/<name>
// A path for a file the running test writes: unique to the test (suite and name) and
// the process, so tests run in parallel (ctest -j, MPI ranks) never share a file.
std::string temp_path(const std::string& name);

// The exception message of fn(), or "" if it did not throw E.
template <class E, class F> std::string message_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// Whole-file helpers for tests that build (corrupt) files byte by byte.
std::string read_all(const std::string& path);
void write_all(const std::string& path, const std::string& data);
// Whether an AtomicFile temporary of `path` ("<path>.tmp...") lies beside it.
bool has_temporaries(const std::string& path);

// A small tokenizer.json laid out as LLaMA-3's: the 256 byte tokens (id = byte value), "bc"
// (256) and "bcb" (257), merges "bc b" (rank 0) and "b c" (rank 1), and the two special
// tokens (258, 259).
std::string small_llama3_tokenizer_json();
// GPT-2 tokenizer files written by hand: OpenAI's byte -> printable code point mapping as
// UTF-8 (`gpt2_byte_token`, `gpt2_token_of` for a byte string), and a tiny vocabulary
// (the 256 bytes, each merge's result, <|endoftext|>) as <dir>/encoder.json and vocab.bpe.
std::string gpt2_byte_token(unsigned char b);
std::string gpt2_token_of(const std::string& bytes);
struct TinyTokenizerFiles {
  std::string encoder, vocab;
};
TinyTokenizerFiles write_tiny_gpt2_tokenizer(const std::string& dir,
                                             const std::vector<std::pair<std::string, std::string>>& merges);

// The training configuration tests start from: the 97-token fixture model (gpt2_tiny.bin)
// on `train_data`, B=2, T=16, one thread, silent, no samples. Tests change what they test.
train::TrainConfig tiny_train_config(const std::string& train_data);

// The "step" of every row of a --log-json file, in file order.
std::vector<int64_t> log_steps(const std::string& jsonl_path);

// Debian's chromium, or nullptr when it is not installed (browser tests then skip).
const char* chromium();

// An llm.c token shard of `n` random tokens below `vocab` (uint16), at temp_path(name).
std::string write_random_shard(const std::string& name, int64_t n, int vocab, uint64_t seed);

// The llm.c-layout gradient `name` of a model (stacked over layers; the vocabulary rows
// only, for tensors llm.c stores unpadded), for comparing with a PyTorch fixture.
Tensor stacked_llmc_grad(const nn::Transformer& model, const std::string& name);

// Largest |a - b| and the largest |b| (the reference's scale).
struct Diff {
  double max_abs = 0;
  double ref_scale = 0;
};
Diff compare(const Tensor& actual, const Tensor& expected);

// ||actual - expected|| / ||expected|| (L2 over all elements, in fp64): how mixed
// precision's gradients are compared with fp32's and autocast's.
double relative_l2(const Tensor& actual, const Tensor& expected);

// Mixed precision's gradients (every llm.c tensor of `model`, after a backward) against
// the fp32 reference's and PyTorch autocast's (`grad.<name>` in each file): each fp32,
// within 1e-2 relative L2 of both, and more than 1e-4 from fp32's (or the GEMMs did not
// run in bf16). Returns the ranges, for the test to print.
struct Bf16GradientDiffs {
  double best_vs_fp32 = 1, worst_vs_fp32 = 0, worst_vs_autocast = 0;
};
Bf16GradientDiffs expect_bf16_gradients(const nn::Transformer& model, const io::SafetensorsFile& fp32,
                                        const io::SafetensorsFile& autocast);

// Expects allclose(actual, expected): |a - e| <= atol + rtol * |e| elementwise.
void expect_close(const Tensor& actual, const Tensor& expected, double rtol, double atol, const std::string& what);

// Random fp64 tensor with values in [-1, 1) from a fixed seed.
Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype = DType::F64);

// Finite-difference gradient check in fp64: for f mapping inputs to a tensor, compares
// autograd's d sum(f(x) * w)/dx (w a fixed random weighting) with central differences.
// Returns the worst relative error over all inputs and elements.
double gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs,
                 double eps = 1e-6);

// The main() of a test program run under mpirun (test_dist, test_parallel): runs every
// test on every rank over a world of all processes (`*world` points at it meanwhile).
// Only rank 0 prints progress; the others print their failures, prefixed with the rank.
// The exit code is non-zero on every rank when any rank failed, so no rank waits for
// another at a collective after a failure.
int run_tests_under_mpi(int argc, char** argv, dist::World** world);
// A name that every rank of `world` agrees on and that no earlier run of the suite used:
// rank 0's process id and start time (ids repeat across runs, and a directory an earlier
// run left, checkpoints in it, must never be taken for this run's). For paths that rank 0
// writes and every rank reads.
std::string shared_run_id(const dist::World& world);

}  // namespace tally::test
