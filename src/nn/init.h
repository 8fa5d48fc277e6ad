// A model's first weights, drawn from a seed as GPT-2 and llm.c draw them: N(0, 0.02),
// the residual projections N(0, 0.02 / sqrt(2L)), biases 0, norm weights 1, the padded
// rows of the embedding (and head) 0. Drawn in llm.c's tensor order (nn/llmc_layout.h),
// so a shard holds exactly the values the whole model would there.
#pragma once
#include <cstdint>

#include "nn/transformer.h"

namespace tally::nn {

void init_weights(Transformer& model, uint64_t seed);

}  // namespace tally::nn
