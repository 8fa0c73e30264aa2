"""The seed's claims that the benchmark shows beside its own rows: the times of its table (``visattn-bench
--ops``) and the longest sequence each kind of attention handles (``visattn-bench max-tokens``)."""
from __future__ import annotations

from visattn.bench.sweep import EXPLICIT_SOFTMAX

# The seed's table (ms; None: out of memory) for its "standard", "sparse" (Longformer-style) and "linear"
# attention, keyed by tokens, and the rows of the ops benchmark each claim is compared with.
SEED_CLAIMS_MS: dict[int, dict[str, float | None]] = {
    512: {"standard": 100.0, "sparse": 80.0, "linear": 60.0},
    2048: {"standard": 1600.0, "sparse": 200.0, "linear": 100.0},
    8192: {"standard": None, "sparse": 800.0, "linear": 300.0},
}
# The seed's "maximum sequence length" of each kind of attention (tokens, "~" in the seed).
SEED_MAX_TOKENS: dict[str, int] = {"standard": 1024, "sparse": 8192, "linear": 65536}
SEED_CLAIM_OF_ROW = {
    "softmax": "standard",
    EXPLICIT_SOFTMAX: "standard",
    "sparse": "sparse",
    "longformer": "sparse",
    "linear": "linear",
}


def seed_claim(attn: str, tokens: int) -> str:
    """The claim compared with row ``attn`` at ``tokens``, e.g. ``"linear: 60"``; empty where there is none."""
    claim = SEED_CLAIM_OF_ROW.get(attn)
    if claim is None or tokens not in SEED_CLAIMS_MS:
        return ""
    ms = SEED_CLAIMS_MS[tokens][claim]
    return f"{claim}: {'OOM' if ms is None else f'{ms:g}'}"
