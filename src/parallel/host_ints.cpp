// Small host-side collectives over a Comm for the ranks' start-up and save agreements: the values
// staged in i32 on the comm's device (the dtype every comm moves), the collective, then read back
// (the copies wait for the device, NCCL's stream included).
#include <cstring>

#include "moe/comm.hpp"
#include "moe/memory.hpp"

namespace moe {

std::vector<int32_t> all_gather_ints(Comm& comm, const std::vector<int32_t>& mine) {
  const auto n = static_cast<int64_t>(mine.size()), world = int64_t{comm.world()};
  Buffer one(comm.device(), mine.size() * sizeof(int32_t)),
      all(comm.device(), static_cast<size_t>(n * world) * sizeof(int32_t));
  const Tensor t_one = one.as(DType::i32, {n}), t_all = all.as(DType::i32, {n * world});
  copy_from_host(t_one, mine.data());
  comm.all_gather(t_all, t_one);
  std::vector<int32_t> table(static_cast<size_t>(n * world));
  copy_to_host(table.data(), t_all);
  return table;
}

}  // namespace moe
