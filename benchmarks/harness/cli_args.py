"""The command-line flags the benchmark scripts share, each defined once (type, help), so that `--repeats` or
`--block-size` reads the same in every script's --help. A script asks for a shared flag by passing its default
(each keeps the default it has always had: the README and notes quote them) and adds only its own flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parser(doc: str, *, model: str | None = None, threads: int | None = None, repeats: int | None = None,
           block_size: int | None = None, json_path: str | None = None) -> argparse.ArgumentParser:
    """A parser described by the first line of the script's docstring `doc`, with the shared flags whose
    default is given (None: the script has no such flag). `json_path` is the flag's name (`--json` or
    `--json-out`, as each script has always spelled it)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if model is not None:
        ap.add_argument("--model", default=model, help="the model to run (default %(default)s)")
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help="torch threads (default %(default)s)")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats,
                        help="rounds of each measurement (default %(default)s)")
    if block_size is not None:
        ap.add_argument("--block-size", type=int, default=block_size,
                        help="KV cache block size in tokens (default %(default)s)")
    if json_path is not None:
        ap.add_argument(json_path, type=Path, default=None, metavar="PATH", help="also write the results here (JSON)")
    return ap
