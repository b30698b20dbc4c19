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


def build_textcls(alone_from: int | None = None) -> Any:
    """The W3 classifier (seed 0); call it as ``model(padded_ids, lengths)``.  With
    ``alone_from``, a pass padded to at least that length runs its rows one at a time,
    each cut to its own length (same logits; see ``build_served``)."""
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
            h = self.enc(self.emb(ids), src_key_padding_mask=pad)
            h = h.masked_fill(pad.unsqueeze(-1), 0.0)
            return self.head(h.sum(1) / lens[:, None].to(h.dtype))

    torch.manual_seed(0)
    return TextClassifier().eval()


ALONE_FROM = 256


def build_served() -> Any:
    """The classifier as the demo model ``textcls`` serves it: a pass padded to 256 or
    more runs its rows one at a time at their own lengths.  On CPU, with PyTorch's fast
    path, long rows cost more per token batched and padded than alone (bench: W3's
    per-bucket sweep), while short rows gain from batching."""
    return build_textcls(ALONE_FROM)
