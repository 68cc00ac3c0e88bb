#!/usr/bin/env python3
"""Checks that an exported checkpoint loads in Hugging Face transformers as MixtralForCausalLM and
computes the same logits as moe-train.

Usage: check_hf_export.py HF_DIR SHARD LOGITS_BIN BATCH SEQ_LEN
  HF_DIR      output of `moe-train export`
  SHARD       the token shard `moe-train eval --data` read (llm.c layout)
  LOGITS_BIN  written by `moe-train eval --batches 1 --batch-size BATCH --seq-len SEQ_LEN
              --logits-out LOGITS_BIN` (float32 [BATCH*SEQ_LEN, V])
Prints the max absolute logit difference and both losses; exits 1 when they disagree.
"""
import json
import sys

import numpy as np
import torch
import transformers
from transformers import MixtralForCausalLM


def read_shard(path, count):
    header = np.fromfile(path, dtype="<i4", count=256)
    magic, version = int(header[0]), int(header[1])
    dtype = {(20240520, 1): "<u2", (20240801, 7): "<u4"}[(magic, version)]
    return np.fromfile(path, dtype=dtype, count=count, offset=1024).astype(np.int64)


def main():
    hf_dir, shard, logits_bin, batch, seq_len = sys.argv[1:6]
    b, t = int(batch), int(seq_len)
    tokens = read_shard(shard, b * t + 1)
    ids = torch.tensor(tokens[: b * t].reshape(b, t))
    targets = torch.tensor(tokens[1 : b * t + 1].reshape(b, t))
    model = MixtralForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits.float().reshape(b * t, -1)
    ours = torch.from_numpy(np.fromfile(logits_bin, dtype="<f4").reshape(b * t, -1))
    diff = (hf_logits - ours).abs().max().item()
    scale = hf_logits.abs().max().item()
    hf_loss = torch.nn.functional.cross_entropy(hf_logits, targets.reshape(-1)).item()
    our_loss = torch.nn.functional.cross_entropy(ours, targets.reshape(-1)).item()
    report = {"transformers": transformers.__version__, "torch": torch.__version__,
              "max_abs_logit_diff": diff, "max_abs_logit": scale, "hf_loss": hf_loss,
              "moe_train_loss": our_loss, "tokens": b * t}
    print(json.dumps(report))
    ok = diff <= 1e-4 * max(1.0, scale) and abs(hf_loss - our_loss) <= 1e-5 * max(1.0, hf_loss)
    print("MATCH" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
