"""Pieces every ``mcserve`` sub-command shares: the one-line error, argparse value types (the
``--delta-scale`` value among them) and the ``--device`` check.

This module imports nothing from mcserve's subpackages, only the ground module
``mcserve.config`` (and torch only inside :func:`check_device`), so ``mcserve.cli``,
``mcserve.eval.cli`` and ``mcserve.server.cli_serve`` can all import it without importing one
another.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mcserve.config import normalize_delta_scale

__all__ = [
    "EXIT_USAGE",
    "CLIError",
    "check_device",
    "delta_scale_arg",
    "first_line",
    "non_negative_float",
    "parse_delta_scale",
    "positive_int",
]

EXIT_USAGE = 2
DEVICE_HELP = "cpu, cuda or cuda:N"


class CLIError(Exception):
    """An error reported to the user as one line (``mcserve: error: ...``), exit status 2."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {val}")
    return val


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0 (not NaN)."""
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not val >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return val


def parse_delta_scale(text: str) -> float | tuple[float, ...]:
    """A ``--delta-scale`` value: ``1.5`` (every layer), ``1.2,1,0.8`` (one per layer), or the
    path of a JSON file holding a number, a list, or an object with a ``delta_scale`` field (as
    ``mcserve eval calibrate-delta`` writes). A bad value is a ValueError naming
    ``delta_scale`` (the values are checked by ``mcserve.config.normalize_delta_scale``)."""
    text = text.strip()
    path = Path(text)
    if text.lower().endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"delta_scale file {text}: {e}") from None
        if isinstance(data, dict):
            if "delta_scale" not in data:
                raise ValueError(f"delta_scale file {text}: no 'delta_scale' field")
            data = data["delta_scale"]
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        normalize_delta_scale(data, len(data) if isinstance(data, list) and data else 1)
        return tuple(float(x) for x in data) if isinstance(data, list) else float(data)
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"delta_scale must be a number, a comma-separated list of numbers or "
                         f"a JSON file, got {text!r}") from None
    if not vals:
        raise ValueError("delta_scale is empty")
    normalize_delta_scale(vals, len(vals))
    return vals[0] if len(vals) == 1 else tuple(vals)


def delta_scale_arg(text: str) -> float | tuple[float, ...]:
    """argparse type: :func:`parse_delta_scale`, its ValueError as the usage error."""
    try:
        return parse_delta_scale(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_device(device: str, flag: str = "--device") -> str:
    """``device`` when this machine can run on it; else :class:`CLIError` saying why.

    Accepts ``cpu`` and ``cuda`` / ``cuda:N`` (when torch sees that GPU); anything else, a device
    string torch does not know or a GPU that is not there, is one clear error rather than a
    traceback from deep inside model loading."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise CLIError(f"{flag} {device!r} is not a device (expected {DEVICE_HELP})") from None
    if dev.type == "cpu":
        return device
    if dev.type != "cuda":
        raise CLIError(f"{flag} {device!r}: mcserve runs on cpu or cuda only "
                       f"(expected {DEVICE_HELP})")
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch sees no CUDA GPU on this machine")
        raise CLIError(f"{flag} {device!r}: {why}; use {flag} cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise CLIError(f"{flag} {device!r}: this machine has {count} CUDA "
                       f"device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    return device
