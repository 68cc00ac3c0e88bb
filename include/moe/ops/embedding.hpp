// Token embedding lookup.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// out[n, :] = table[ids[n], :]        out: [N, d], ids: [N] i32 in [0, V), table: [V, d]
// An id outside [0, V) throws InputError naming the id and V (both forward and backward).
MOE_OP(embedding_forward, (Ctx & ctx, Tensor out, Tensor ids, Tensor table), (ctx, out, ids, table))
// dtable[ids[n], :] += dout[n, :]     (deterministic: rows summed in token order)
// dtable: [V, d] in acc_dtype(dout), dout: [N, d]
MOE_OP(embedding_backward, (Ctx & ctx, Tensor dtable, Tensor dout, Tensor ids),
       (ctx, dtable, dout, ids))

}  // namespace moe
