#!/usr/bin/env python3
"""Renders a run's metrics.jsonl to PNG: loss / lr / grad-norm curves and a per-layer expert-load
heatmap (the last logged step's share of routed slots per expert, one row per MoE layer).

Usage: scripts/plot_metrics.py RUN_DIR_OR_METRICS_JSONL [--out DIR]
Writes DIR/curves.png and DIR/expert_load.png (DIR defaults to the run directory).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    train, evals = {}, {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{number}: skipping a malformed line", file=sys.stderr)
                continue
            # the trainer's train and eval records (a stop's record, other tools' notes left out);
            # a resumed run may log a step again: the last record of a step wins
            kind, step = rec.get("kind", "train"), rec.get("step")
            if kind in ("train", "eval") and isinstance(step, int):
                (evals if kind == "eval" else train)[step] = rec
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def plot_curves(train, evals, out):
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in train], label="train loss")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss")
    axes[0].set_title("LM loss")
    axes[0].legend()
    axes[1].plot(steps, [r["lr"] for r in train])
    axes[1].set_title("learning rate")
    axes[2].plot(steps, [r["grad_norm"] for r in train])
    axes[2].set_title("gradient norm")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_expert_load(train, out):
    last = next((r for r in reversed(train) if r.get("expert_load")), None)
    fig, ax = plt.subplots(figsize=(8, 4))
    if last is None:
        ax.text(0.5, 0.5, "no MoE layers", ha="center", va="center")
        ax.set_axis_off()
    else:
        load = last["expert_load"]
        image = ax.imshow(load, aspect="auto", cmap="viridis")
        fig.colorbar(image, ax=ax, label="share of routed slots")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_title(f"expert load at step {last['step']} (maxvio {last.get('maxvio_max', 0):.3f})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory (train.out_dir) or a metrics.jsonl file")
    parser.add_argument("--out", help="directory for the PNG files (default: the run directory)")
    args = parser.parse_args()
    path = args.run if args.run.endswith(".jsonl") else os.path.join(args.run, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path} not found")
    train, evals = read_metrics(path)
    if not train:
        sys.exit(f"error: {path} holds no training records")
    out_dir = args.out or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    plot_curves(train, evals, os.path.join(out_dir, "curves.png"))
    plot_expert_load(train, os.path.join(out_dir, "expert_load.png"))
    print(f"wrote {out_dir}/curves.png and {out_dir}/expert_load.png")


if __name__ == "__main__":
    main()
