"""The W3 model and bodies (docs/benchmarks.md): a seeded one-layer transformer text
classifier over token ids, and the 64 request bodies of 8 to 458 tokens.

Embedding(8192, 128) -> TransformerEncoderLayer(128, 4 heads, ff 256, dropout 0,
batch_first) with the padding mask -> mean over the real tokens -> Linear(128, 4), seed 0,
built in that order (so the weights are the anchors' ones).  Its forward takes
``(padded, lengths)``, as redbatch hands a variable-length pass: the mask is implied by
the lengths.  Imports only torch and numpy, so that the Ray Serve comparison
(``baselines/ray_app.py``, run by another Python) can load this file too."""

from __future__ import annotations

import json
from typing import Any

VOCAB, DIM, HEADS, FF, OUT = 8192, 128, 4, 256, 4
BODIES, MIN_LEN, MAX_LEN, LEN_SEED = 64, 8, 512, 3


def lengths() -> list[int]:
    """The 64 lengths: log-uniform on [8, 512] (numpy PCG64, seed 3), rounded, clipped."""
    import numpy as np

    u = np.random.Generator(np.random.PCG64(LEN_SEED)).uniform(
        np.log(MIN_LEN), np.log(MAX_LEN), BODIES)
    return [int(min(max(round(float(np.exp(v))), MIN_LEN), MAX_LEN)) for v in u]


def token_ids(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 31) % VOCAB for j in range(n)]


def bodies() -> list[dict[str, list[int]]]:
    """Body i: ``input_ids[j] = (i*7919 + j*31) % 8192``, ``attention_mask`` = L ones."""
    return [{"input_ids": token_ids(i, n), "attention_mask": [1] * n}
            for i, n in enumerate(lengths())]


def bodies_text() -> str:
    """The bodies as ``wrk/w3.lua`` reads them: a JSON list, one compact body per line."""
    return "[\n" + ",\n".join(json.dumps(b) for b in bodies()) + "\n]\n"


def build_textcls(alone_from: int | None = None, math_from: int | None = None) -> Any:
    """The W3 classifier (seed 0); call it as ``model(padded_ids, lengths)``.  With
    ``alone_from``, a pass padded to at least that length runs its rows one at a time,
    each cut to its own length; with ``math_from``, a pass padded to at least that
    length runs the encoder layer through ``scaled_dot_product_attention`` instead of
    PyTorch's fused fast path (same weights, same logits; see ``build_served``)."""
    import torch

    class TextClassifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.enc = torch.nn.TransformerEncoderLayer(
                d_model=DIM, nhead=HEADS, dim_feedforward=FF, dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(DIM, OUT)

        def forward(self, ids: Any, lens: Any) -> Any:
            if alone_from is not None and ids.shape[1] >= alone_from:
                return torch.cat([self.padded(ids[i:i + 1, :n], lens[i:i + 1])
                                  for i, n in enumerate(lens.tolist())])
            return self.padded(ids, lens)

        def padded(self, ids: Any, lens: Any) -> Any:
            pad = torch.arange(ids.shape[1], device=ids.device)[None, :] >= lens[:, None]
            x = self.emb(ids)
            long = math_from is not None and ids.shape[1] >= math_from
            h = encode_math(self.enc, x, pad) if long else self.enc(x, src_key_padding_mask=pad)
            h = h.masked_fill(pad.unsqueeze(-1), 0.0)
            return self.head(h.sum(1) / lens[:, None].to(h.dtype))

    torch.manual_seed(0)
    return TextClassifier().eval()


def encode_math(layer: Any, x: Any, pad: Any) -> Any:
    """``layer(x, src_key_padding_mask=pad)`` for a post-norm, ReLU, batch-first
    ``TransformerEncoderLayer`` in eval mode, written out: attention through
    ``scaled_dot_product_attention``, then the feed-forward block."""
    import torch.nn.functional as F

    attn, (b, n, d) = layer.self_attn, x.shape
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(b, n, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
    keep = ~pad[:, None, None, :]
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, d)
    x = layer.norm1(x + attn.out_proj(a))
    return layer.norm2(x + layer.linear2(F.relu(layer.linear1(x))))


ALONE_FROM = 257  # rows of a pass padded past 256 (the 512 bucket) run alone
MATH_FROM = 65  # passes padded past 64 (the 128 bucket and up) skip the fused fast path


def build_served() -> Any:
    """The classifier as the demo model ``textcls`` serves it, measured per length
    bucket on this CPU (bench: W3's per-bucket sweep): passes padded past 64 tokens (the
    128 bucket and up) run the attention through ``scaled_dot_product_attention``,
    which beats PyTorch's fused fast path there (1.5 to 2x at 256 and 512 tokens) while
    the fast path wins on short passes; and the rows of a pass padded past 256 (the 512
    bucket) run one at a time at their own lengths (257 to 512 tokens: padding them all
    to one length wastes more than batching gains).  The thresholds sit between the
    default (power-of-two) buckets, so that a pass padded to its longest item
    (``pad_to_longest``) takes the same path as its bucket would."""
    return build_textcls(ALONE_FROM, MATH_FROM)
