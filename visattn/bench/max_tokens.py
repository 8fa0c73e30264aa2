"""The max-tokens search: the largest token count each attention type runs forward and trains (batch 1)
within a memory limit (``visattn-bench max-tokens``).

For each row and mode the token count doubles from ``--min-tokens`` until a trial fails, then the
interval between the last count that fitted and the first that did not is bisected until it is
narrower than ``--tolerance`` of the count that fitted (:func:`search_largest`). A count of n tokens
runs on the most square grid of at most n tokens (:func:`square_grid`): ``isqrt(n)`` rows of
``n // isqrt(n)`` tokens, e.g. 1,024 -> 32 x 32, 2,048 -> 45 x 45 (2,025 tokens), 8,192 -> 90 x 91
(8,190); every count is reported as the tokens of the grid that ran. Model rows (default) run the model
(``--model``, images of grid x patch pixels, one class token on top) for every type beside ``timm`` and
``floor`` as in the model sweep; ``--ops`` runs one layer's token mixing alone beside
``softmax_explicit``, softmax attention with its N x N scores written out. Forward: one forward
under ``inference_mode``. Training: forward, backward and, for a model, an AdamW step, twice, so that
the peak includes the optimizer's state.

Each count is one trial in its own capped process (:mod:`visattn.bench.trial`). A trial that runs out
of memory fails that count; one that passes ``--trial-timeout`` seconds ends the row's search with the
last count that fitted as a lower bound (the memory limit lies above it); an error of any other kind
ends the row with its message. The files are written anew after every trial: a command stopped part-way
(SIGTERM, Ctrl-C) leaves the rows it finished, the trials of the row it was in (marked stopped) and the rows it
did not reach (not searched).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import timm
import torch

from visattn.bench.flops import ViTShape
from visattn.bench.sweep import EXPLICIT_SOFTMAX, FLOOR, TIMM, Case, build_layer, build_model
from visattn.bench.trial import Trial, run_trial

# The reference rows: timm's stock model and the model without token mixing; the fused op and its explicit twin.
MODEL_REFERENCES = (TIMM, FLOOR)
OP_REFERENCES = ("softmax", EXPLICIT_SOFTMAX)


@dataclass(frozen=True)
class Search:
    """What :func:`search_largest` found."""

    largest: int | None  # the largest count that fitted; None if not even the first did
    smallest_failing: int | None  # the smallest count that did not fit; None if none failed
    trials: tuple[tuple[int, bool | None], ...]  # (count, verdict) in the order asked

    @property
    def undecided(self) -> bool:
        """The search stopped at a trial that could not tell (the time limit)."""
        return self.trials[-1][1] is None


def search_largest(
    fits: Callable[[int], bool | None], start: int, stop: int, tolerance: float = 0.0
) -> Search:
    """The largest n in [start, stop] with ``fits(n)``, for a ``fits`` that holds up to some n and not beyond.

    Doubles n from ``start`` (the last step capped at ``stop``) until ``fits`` is False, then bisects
    between the last n that fitted and the first that did not until they are at most
    ``max(1, floor(tolerance * last fitting n))`` apart: ``tolerance=0`` finds the exact n in at most
    ``floor(log2(n / start)) + 2`` doubling and ``ceil(log2(n))`` bisecting trials. A verdict of None
    (undecided) ends the search where it is.
    """
    if start < 1 or stop < start:
        raise ValueError(f"need 1 <= start <= stop, got start={start}, stop={stop}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    trials: list[tuple[int, bool | None]] = []

    def ask(n: int) -> bool | None:
        verdict = fits(n)
        trials.append((n, verdict))
        return verdict

    largest, failing, n = None, None, start
    while failing is None:
        verdict = ask(n)
        if verdict is None or (verdict and n == stop):
            return Search(n if verdict else largest, None, tuple(trials))
        if verdict:
            largest, n = n, min(2 * n, stop)
        else:
            failing = n
    while largest is not None and failing - largest > max(1, math.floor(tolerance * largest)):
        middle = (largest + failing) // 2
        verdict = ask(middle)
        if verdict is None:
            break
        if verdict:
            largest = middle
        else:
            failing = middle
    return Search(largest, failing, tuple(trials))


def square_grid(tokens: int) -> tuple[int, int]:
    """The most square grid (H, W) of at most ``tokens`` tokens: H = isqrt(tokens), W = tokens // H, so
    H <= W <= H + 2 and H x W > tokens - H."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    h = math.isqrt(tokens)
    return h, tokens // h


class _RowError(Exception):
    """A trial failed for another reason than memory or time: the row's search ends with its message."""


@dataclass
class Row:
    """The search of one attention type in one mode."""

    attn: str
    mode: str
    trials: dict[tuple[int, int], Trial] = field(default_factory=dict)  # by grid, in the order run
    search: Search | None = None
    error: str = ""
    stopped: bool = False  # the command was stopped (SIGTERM, Ctrl-C) during this row's search

    def trial_of(self, tokens: int | None) -> Trial | None:
        return None if tokens is None else self.trials[square_grid(tokens)]

    @property
    def largest(self) -> Trial | None:
        """The largest count that fitted: the search's answer, or in a search stopped part-way the largest
        trial that fitted so far."""
        if self.search is not None:
            return self.trial_of(self.search.largest)
        return max((t for t in self.trials.values() if t.status == "ok"), key=lambda t: t.tokens, default=None)

    @property
    def failing(self) -> Trial | None:
        """The smallest count that did not fit (ran out of memory); None where none failed."""
        return self.trial_of(self.search.smallest_failing) if self.search else None

    @property
    def timed_out(self) -> Trial | None:
        """The trial that ran past the time limit and so ended the search; None where none did. The largest
        count that fitted is then a lower bound: the memory limit lies above it, and below :attr:`failing`
        where a larger count had run out of memory before."""
        if self.search is None or not self.search.undecided:
            return None
        return self.trial_of(self.search.trials[-1][0])

    @property
    def stopped_by(self) -> str:
        """Why the search ended: error, stopped, time, oom or ceiling (--max-tokens fitted)."""
        if self.error:
            return "error"
        if self.stopped:
            return "stopped"
        if self.timed_out is not None:
            return "time"
        return "ceiling" if self.failing is None else self.failing.status


class MaxTokensPlan:
    """The rows of a ``max-tokens`` run and their cases, from its parsed arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        references = args.references
        if args.ops:
            self.rows = references + [a for a in args.attn if a not in references and a != FLOOR]
            self.patch = (1, 1)
        else:
            self.rows = references + [a for a in args.attn if a not in references]
            with torch.device("meta"):
                model = timm.create_model(args.model, attn=FLOOR, num_classes=args.num_classes, **args.model_kwargs)
            self.patch = ViTShape.from_model(model).patch_size

    def case(self, attn: str, mode: str, grid: tuple[int, int]) -> Case:
        a = self.args
        common = dict(
            attn=attn, mode=mode, batch_size=1, device=a.device, dtype=a.dtype, compile=False,
            attn_kwargs=a.attn_kwargs.get(attn, {}),
        )
        if a.ops:
            return Case(kind="op", size=grid, num_heads=a.heads, head_dim=a.head_dim, **common)
        return Case(
            kind="model", size=(grid[0] * self.patch[0], grid[1] * self.patch[1]), model_name=a.model,
            timm_name=a.timm_model, num_classes=a.num_classes, model_kwargs=a.model_kwargs,
            grad_checkpointing=a.grad_checkpointing, **common,
        )

    def check(self, grid: tuple[int, int]) -> None:
        """Build every row on the meta device: a bad option fails here, before any trial."""
        for attn in self.rows:
            case = self.case(attn, "infer", grid)
            if case.kind == "model":
                build_model(case, device="meta")
            elif attn != EXPLICIT_SOFTMAX:
                build_layer(case, device="meta")

    def search(self, row: Row, report: Callable[[Row, Trial], None]) -> None:
        """Search ``row`` (its type and mode) in place, calling ``report`` after every trial."""
        a, attn, mode = self.args, row.attn, row.mode

        def fits(tokens: int) -> bool | None:
            grid = square_grid(tokens)
            if grid not in row.trials:
                row.trials[grid] = trial = run_trial(self.case(attn, mode, grid), grid, a.max_memory, a.trial_timeout)
                report(row, trial)
                if trial.status == "error":
                    raise _RowError(trial.message)
            return {"ok": True, "oom": False}.get(row.trials[grid].status)

        try:
            row.search = search_largest(fits, a.min_tokens, a.max_tokens, a.tolerance)
        except _RowError as err:
            row.error = str(err)
