#!/usr/bin/env python3
"""PyTorch's flash SDPA (causal, bf16) at the shapes of `moe-train bench`'s attention rows, the
peer for the attention bar of issue 5. FLOPs are counted as the bench counts them: forward
2 * B * H * T^2 * hd (the unmasked half of QK^T and PV), backward 2.5 times that.
Usage: python3 scripts/sdpa_bench.py [B,T,H,hd ...]  (default 16,1024,16,64 4,4096,16,64)"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed_ms(fn, iters=50):
    for _ in range(5):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]] or [(16, 1024, 16, 64),
                                                                            (4, 4096, 16, 64)]
    for b, t, h, hd in shapes:
        q, k, v = (torch.randn(b, h, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(b, h, t, hd, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * b * h * t * t * hd
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fwd = timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            bwd = timed_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        print(f"sdpa {b}x{t}x{h}x{hd}: forward {fwd * 1e3:.1f} us {flops / fwd / 1e9:.1f} TFLOP/s, "
              f"backward {bwd * 1e3:.1f} us {2.5 * flops / bwd / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
