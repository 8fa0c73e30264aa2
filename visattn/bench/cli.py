"""The ``visattn-bench`` command: ``visattn-bench [flags]`` runs the sweep (:mod:`visattn.bench.sweep_cli`),
``visattn-bench max-tokens [flags]`` the max-tokens search (:mod:`visattn.bench.max_tokens_cli`)."""
from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from visattn.bench import max_tokens_cli, sweep_cli
from visattn.bench.arguments import MAX_TOKENS


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (what ``timeout`` and job schedulers send) unwinds like Ctrl-C inside the block: workers and
    trials are ended and what was measured is written."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [MAX_TOKENS]:
        args = max_tokens_cli.parse_args(argv[1:])
        with _sigterm_unwinds():
            max_tokens_cli.run(args)
        return 0
    args = sweep_cli.parse_args(argv)
    with _sigterm_unwinds():
        sweep_cli.run(args)
    return 0
