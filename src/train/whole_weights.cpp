// Whole weights for a ZeRO-3 model (see whole_weights.hpp).
#include "train/whole_weights.hpp"

namespace moe {

std::unique_ptr<Model> make_whole_copy(const Model& model) {
  return std::make_unique<Model>(model.config(), model.dtype(), Device{DeviceType::cpu, 0}, 1, 1);
}

void gather_whole(Ctx& ctx, Model& model, Model* whole) {
  model.gather_params(ctx, whole != nullptr ? whole->params().data : nullptr);
  if (whole == nullptr) return;
  const std::vector<Tensor> from = model.router_biases(), to = whole->router_biases();
  for (size_t i = 0; i < from.size(); ++i) copy_to_host(to[i].data, from[i]);
}

void scatter_whole(Ctx& ctx, const Model& whole, Model& model) {
  model.scatter_params(ctx, whole.params().data);
  const std::vector<Tensor> from = whole.router_biases(), to = model.router_biases();
  for (size_t i = 0; i < from.size(); ++i) copy_from_host(to[i], from[i].data);
}

}  // namespace moe
