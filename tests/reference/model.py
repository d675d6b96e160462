"""Independent PyTorch reference of the llama architecture as stored in GGUF.

Everything is plain float32 PyTorch (1.13: no SDPA, no torch.compile); attention
is written out by hand. Weights come from gguf_reader (F32/F16/BF16 dequantized
to float32 exactly).

    m = ReferenceModel.from_gguf("model.gguf")
    logits = m.logits([1, 403, 407])          # [n_tokens, vocab] float32 tensor
    ids = m.greedy([1, 403, 407], n=64)       # generated ids, prompt not included
"""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_reader import GGUFReader  # noqa: E402


class Config:
    def __init__(self, r, vocab_rows):
        arch = r.get("general.architecture")
        if arch != "llama":
            raise ValueError("general.architecture is %r, the reference only knows 'llama'" % arch)

        def need(key):
            if key not in r.metadata:
                raise ValueError("missing metadata key " + key)
            return r.metadata[key]

        self.d_model = int(need("llama.embedding_length"))
        self.n_layers = int(need("llama.block_count"))
        self.n_heads = int(need("llama.attention.head_count"))
        self.n_kv_heads = int(r.get("llama.attention.head_count_kv", self.n_heads))
        self.d_ff = int(need("llama.feed_forward_length"))
        self.context = int(need("llama.context_length"))
        self.eps = float(need("llama.attention.layer_norm_rms_epsilon"))
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("bad head counts: d_model %d, heads %d, kv heads %d"
                             % (self.d_model, self.n_heads, self.n_kv_heads))
        self.head_dim = self.d_model // self.n_heads
        self.n_rot = int(r.get("llama.rope.dimension_count", self.head_dim))
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError("bad rope dimension count %d (head_dim %d)" % (self.n_rot, self.head_dim))
        self.rope_base = float(r.get("llama.rope.freq_base", 10000.0))
        if "llama.vocab_size" in r.metadata:
            self.vocab = int(r.metadata["llama.vocab_size"])
        elif "tokenizer.ggml.tokens" in r.metadata:
            self.vocab = len(r.metadata["tokenizer.ggml.tokens"])
        else:
            self.vocab = vocab_rows

    def __repr__(self):
        return ("Config(d_model=%d, n_layers=%d, n_heads=%d, n_kv_heads=%d, head_dim=%d, d_ff=%d, context=%d, "
                "vocab=%d, n_rot=%d, rope_base=%g, eps=%g)"
                % (self.d_model, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.d_ff,
                   self.context, self.vocab, self.n_rot, self.rope_base, self.eps))


def rmsnorm(x, w, eps):
    # x * rsqrt(mean(x^2) + eps) * w, over the last dim
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rope(x, positions, n_rot, base):
    """llama.cpp "normal" RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of the first n_rot dims of each head.

    x: [T, H, head_dim]; positions: [T] int tensor. Angles are computed in float64 then rounded.
    """
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    inv_freq = base ** (-2.0 * i / n_rot)                               # [n_rot/2]
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]       # [T, n_rot/2]
    cos = torch.cos(ang).to(x.dtype)[:, None, :]                         # [T, 1, n_rot/2]
    sin = torch.sin(ang).to(x.dtype)[:, None, :]
    xr = x[..., :n_rot]
    x0 = xr[..., 0::2]
    x1 = xr[..., 1::2]
    out = torch.empty_like(xr)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    if n_rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., n_rot:]], dim=-1)


class ReferenceModel:
    def __init__(self, cfg, weights, tied):
        self.cfg = cfg
        self.w = weights
        self.tied = tied

    @classmethod
    def from_gguf(cls, path, dtype=torch.float32):
        r = GGUFReader(path)
        emb = r.tensor("token_embd.weight")
        cfg = Config(r, emb.shape[0])
        c = cfg

        def get(name, shape):
            a = r.tensor(name)
            if tuple(a.shape) != tuple(shape):
                raise ValueError("tensor %s has shape %s, expected %s" % (name, a.shape, shape))
            return torch.from_numpy(np.array(a, dtype=np.float32)).to(dtype)

        kv_dim = c.n_kv_heads * c.head_dim
        w = {"token_embd": get("token_embd.weight", (c.vocab, c.d_model)),
             "output_norm": get("output_norm.weight", (c.d_model,))}
        tied = "output.weight" not in r.tensors
        w["output"] = w["token_embd"] if tied else get("output.weight", (c.vocab, c.d_model))
        for l in range(c.n_layers):
            p = "blk.%d." % l
            w[p + "attn_norm"] = get(p + "attn_norm.weight", (c.d_model,))
            w[p + "attn_q"] = get(p + "attn_q.weight", (c.d_model, c.d_model))
            w[p + "attn_k"] = get(p + "attn_k.weight", (kv_dim, c.d_model))
            w[p + "attn_v"] = get(p + "attn_v.weight", (kv_dim, c.d_model))
            w[p + "attn_output"] = get(p + "attn_output.weight", (c.d_model, c.d_model))
            w[p + "ffn_norm"] = get(p + "ffn_norm.weight", (c.d_model,))
            w[p + "ffn_gate"] = get(p + "ffn_gate.weight", (c.d_ff, c.d_model))
            w[p + "ffn_up"] = get(p + "ffn_up.weight", (c.d_ff, c.d_model))
            w[p + "ffn_down"] = get(p + "ffn_down.weight", (c.d_model, c.d_ff))
        m = cls(cfg, w, tied)
        m.reader = r
        m.dtype = dtype
        return m

    # -- core forward -------------------------------------------------------------------------------------------

    def new_cache(self):
        """Per-layer lists of K and V, each [T, n_kv_heads, head_dim] after RoPE (K) / as is (V)."""
        return {"k": [None] * self.cfg.n_layers, "v": [None] * self.cfg.n_layers, "n": 0}

    @torch.no_grad()
    def forward(self, tokens, cache=None):
        """Logits [len(tokens), vocab] for `tokens` placed after whatever `cache` already holds.

        Without a cache the tokens start at position 0. With one, the new keys/values are appended to it.
        """
        c, w = self.cfg, self.w
        toks = torch.as_tensor(list(tokens), dtype=torch.long)
        T = toks.shape[0]
        if T == 0:
            raise ValueError("no tokens")
        if int(toks.min()) < 0 or int(toks.max()) >= c.vocab:
            raise ValueError("token id out of range [0, %d)" % c.vocab)
        start = cache["n"] if cache is not None else 0
        if start + T > c.context:
            raise ValueError("sequence of %d tokens exceeds the context of %d" % (start + T, c.context))
        pos = torch.arange(start, start + T)
        group = c.n_heads // c.n_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)

        x = w["token_embd"][toks]                                          # [T, d]
        for l in range(c.n_layers):
            p = "blk.%d." % l
            h = rmsnorm(x, w[p + "attn_norm"], c.eps)
            q = (h @ w[p + "attn_q"].T).view(T, c.n_heads, c.head_dim)
            k = (h @ w[p + "attn_k"].T).view(T, c.n_kv_heads, c.head_dim)
            v = (h @ w[p + "attn_v"].T).view(T, c.n_kv_heads, c.head_dim)
            q = rope(q, pos, c.n_rot, c.rope_base)
            k = rope(k, pos, c.n_rot, c.rope_base)
            if cache is not None:
                if cache["k"][l] is not None:
                    k = torch.cat([cache["k"][l], k], dim=0)
                    v = torch.cat([cache["v"][l], v], dim=0)
                cache["k"][l], cache["v"][l] = k, v
            S = k.shape[0]                                                 # keys: positions 0..S-1
            # GQA: query head hq reads kv head hq // group.
            kh = k.repeat_interleave(group, dim=1).permute(1, 0, 2)        # [H, S, hd]
            vh = v.repeat_interleave(group, dim=1).permute(1, 0, 2)        # [H, S, hd]
            qh = q.permute(1, 0, 2)                                        # [H, T, hd]
            att = (qh @ kh.transpose(1, 2)) * scale                        # [H, T, S]
            # query at absolute position start+t sees keys at positions <= start+t
            mask = torch.arange(S)[None, :] > pos[:, None]                 # [T, S]
            att = att.masked_fill(mask[None, :, :], float("-inf"))
            att = torch.softmax(att, dim=-1)
            o = (att @ vh).permute(1, 0, 2).reshape(T, c.d_model)          # [T, d]
            x = x + o @ w[p + "attn_output"].T
            h = rmsnorm(x, w[p + "ffn_norm"], c.eps)
            g = h @ w[p + "ffn_gate"].T
            u = h @ w[p + "ffn_up"].T
            x = x + (torch.nn.functional.silu(g) * u) @ w[p + "ffn_down"].T
        if cache is not None:
            cache["n"] = start + T
        x = rmsnorm(x, w["output_norm"], c.eps)
        return x @ w["output"].T                                           # [T, vocab]

    # -- conveniences ------------------------------------------------------------------------------------------

    def logits(self, tokens):
        """Logits at every position of `tokens` (row i: after consuming tokens[0..i]), one full pass."""
        return self.forward(tokens)

    def logits_incremental(self, tokens):
        """Same as logits(), but one token at a time through the KV cache (checks the cache path)."""
        cache = self.new_cache()
        return torch.cat([self.forward([t], cache) for t in tokens], dim=0)

    def greedy(self, prompt, n, stop_ids=(), use_cache=True):
        """Generate up to `n` tokens greedily (argmax, lowest id on exact ties) after `prompt`.

        Returns the generated ids only. Generation stops early after emitting an id in `stop_ids`
        (that id is not included) or when the context is full.
        """
        prompt = list(prompt)
        out = []
        if use_cache:
            cache = self.new_cache()
            last = self.forward(prompt, cache)[-1]
        else:
            last = self.forward(prompt)[-1]
        while len(out) < n:
            nxt = int(torch.argmax(last))
            if nxt in stop_ids:
                break
            out.append(nxt)
            if len(out) == n or len(prompt) + len(out) >= self.cfg.context:
                break
            if use_cache:
                last = self.forward([nxt], cache)[-1]
            else:
                last = self.forward(prompt + out)[-1]
        return out


# -- SentencePiece-style piece decoding (for the self-checks) --------------------------------------------------

def piece_bytes(piece):
    """Bytes of one llama/SentencePiece vocabulary piece: '▁' is a space, '<0xNN>' is the byte NN."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def decode(tokens, vocab):
    return b"".join(piece_bytes(vocab[t]) for t in tokens)


def _main():
    import argparse
    ap = argparse.ArgumentParser(description="Run the reference model on token ids.")
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated prompt ids")
    ap.add_argument("-n", type=int, default=16, help="greedy tokens to generate")
    a = ap.parse_args()
    # One thread: on a shared 2-core machine, torch's OpenMP threads spin and run 10x slower under load.
    torch.set_num_threads(1)
    m = ReferenceModel.from_gguf(a.model)
    print(m.cfg)
    ids = [int(t) for t in a.tokens.split(",") if t.strip()]
    out = m.greedy(ids, a.n)
    print(" ".join(map(str, out)))
    vocab = m.reader.get("tokenizer.ggml.tokens")
    if vocab is not None and m.reader.get("tokenizer.ggml.model") == "llama":
        print(decode(ids + out, vocab))


if __name__ == "__main__":
    _main()
