#!/usr/bin/env python3
"""The same model and training step as `merlin train`, in batched float32 PyTorch, for speed comparisons
(bench/train_bench.sh). Correctness is checked elsewhere (check_train_parity.py, against the independent
reference in tests/reference/model.py); this one is written for speed: batched matmuls, fused q|k|v and
gate|up weights, autograd, torch.optim.AdamW, clip_grad_norm_.

    /usr/bin/python3 tests/train/torch_train.py --preset experiment --data DIR/train-00000.tok \
        --batch 8 --seq 256 --steps 10 --threads 2

Prints one JSON line: {"preset", "tokens_per_s", "step_s", "loss"} (tokens/s: median over steps after the first).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from model import rmsnorm, rope  # noqa: E402

PRESETS = {  # dim, heads, layers, context, ffn (src/model/config.cpp)
    "sanity": (32, 2, 2, 64, 128),
    "experiment": (256, 8, 8, 512, 1024),
    "base": (768, 12, 12, 1024, 2048),
}


class Net(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, layers, ffn, vocab, eps=1e-5, theta=10000.0):
        super().__init__()
        self.dim, self.heads, self.kv_heads, self.hd, self.eps, self.theta = dim, heads, kv_heads, dim // heads, eps, theta
        g = torch.Generator().manual_seed(0)

        def mat(rows, cols, std=0.02):
            return torch.nn.Parameter(torch.randn(rows, cols, generator=g) * std)

        resid = 0.02 / math.sqrt(2 * layers)
        self.embd = mat(vocab, dim)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            m = torch.nn.Module()
            m.attn_norm = torch.nn.Parameter(torch.ones(dim))
            m.wqkv = mat(dim + 2 * kv_heads * self.hd, dim)
            m.wo = mat(dim, dim, resid)
            m.ffn_norm = torch.nn.Parameter(torch.ones(dim))
            m.wgu = mat(2 * ffn, dim)
            m.wdown = mat(dim, ffn, resid)
            self.layers.append(m)
        self.out_norm = torch.nn.Parameter(torch.ones(dim))

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T)
        mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        x = self.embd[idx]
        kvd = self.kv_heads * self.hd
        for m in self.layers:
            h = rmsnorm(x, m.attn_norm, self.eps)
            q, k, v = (h @ m.wqkv.T).split([self.dim, kvd, kvd], dim=-1)
            q = rope(q.view(B, T, self.heads, self.hd), pos, self.hd, self.theta).transpose(1, 2)
            k = rope(k.view(B, T, self.kv_heads, self.hd), pos, self.hd, self.theta).transpose(1, 2)
            v = v.view(B, T, self.kv_heads, self.hd).transpose(1, 2)
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            att = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask, dim=-1)
            x = x + (att @ v).transpose(1, 2).reshape(B, T, self.dim) @ m.wo.T
            gate, up = (rmsnorm(x, m.ffn_norm, self.eps) @ m.wgu.T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ m.wdown.T
        return rmsnorm(x, self.out_norm, self.eps) @ self.embd.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sanity", choices=sorted(PRESETS))
    ap.add_argument("--data", required=True, help="token shard written by merlin prepare")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=6e-4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dim, heads, layers, ctx, ffn = PRESETS[a.preset]
    seq = a.seq or min(256, ctx)
    tokens = np.fromfile(a.data, dtype=np.uint16, offset=256).astype(np.int64)
    net = Net(dim, heads, heads, layers, ffn, 50257)
    decay = [p for n, p in net.named_parameters() if p.dim() == 2 and n != "embd"]
    rest = [p for n, p in net.named_parameters() if not (p.dim() == 2 and n != "embd")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(0)
    times, loss = [], float("nan")
    for _ in range(a.steps):
        starts = rng.integers(0, len(tokens) - seq - 1, a.batch)
        batch = torch.from_numpy(np.stack([tokens[s: s + seq + 1] for s in starts]))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = net(batch[:, :-1])
        l = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        l.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = float(l)
    step_s = statistics.median(times[1:] if len(times) > 1 else times)
    print(json.dumps({"preset": a.preset, "tokens_per_s": a.batch * seq / step_s, "step_s": step_s, "loss": loss}))


if __name__ == "__main__":
    main()
