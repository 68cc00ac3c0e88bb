// ZeRO stage 3 and the code that writes or imports whole weights (saving a checkpoint, a Hugging
// Face import): a CPU model of the same config in the master dtype holds them, and the sharded
// model gathers into it or takes its chunks from it. So the checkpoint format and its N-to-M
// resume are the same for every stage: rank 0 writes the whole weights, each rank its optimizer
// ranges. (A resume reads each rank's chunks straight from the file: load_checkpoint.)
#pragma once
#include <memory>

#include "moe/model.hpp"

namespace moe {

// A CPU model of `model`'s config holding every parameter in its master dtype (one token of
// activations: it is never run).
std::unique_ptr<Model> make_whole_copy(const Model& model);
// Every rank calls it (the units are gathered over the comm); `whole`, when not null, receives
// the weights and the router biases.
void gather_whole(Ctx& ctx, Model& model, Model* whole);
// This rank's chunks and the router biases from `whole`.
void scatter_whole(Ctx& ctx, const Model& whole, Model& model);

}  // namespace moe
