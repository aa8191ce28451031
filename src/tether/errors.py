"""User-facing errors.

Every error a user can cause with bad input (config, data, checkpoints, reward code) is a
``TetherError``: the CLI prints its message as one line and exits non-zero, without a traceback.
The message names what is wrong and where (key, file, line, field).
"""

from __future__ import annotations

import os


def one_line(error: BaseException) -> str:
    """An exception's message cut to its first line (its type when empty), for a one-line error that
    quotes a library's or a user's exception."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


_LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file starts


LFS_POINTER_REASON = "a Git LFS pointer, not the file: fetch it with `git lfs pull`"


def is_lfs_pointer(file: str | os.PathLike[str]) -> bool:
    """Whether ``file`` is a Git LFS pointer in place of the file (a clone without ``git lfs``)."""
    try:
        with open(file, "rb") as f:
            return f.read(len(_LFS_POINTER)) == _LFS_POINTER
    except OSError:
        return False


def unreadable_reason(file: str | os.PathLike[str], error: BaseException) -> str:
    """Why a checkpoint file could not be read, in a few words: a Git LFS pointer says so; else the
    reader's own first line (safetensors says "incomplete metadata, file not fully covered" for a
    truncated download), with its type."""
    if is_lfs_pointer(file):
        return LFS_POINTER_REASON
    return f"{type(error).__name__}: {one_line(error)}" if str(error).strip() else type(error).__name__


class TetherError(Exception):
    """An error caused by user input; its message is one line meant for the user."""


class ConfigError(TetherError):
    """A bad config key, value, type, or a missing config file."""


class DataError(TetherError):
    """A bad dataset file or row; the message names file, line and field."""


class CheckpointError(TetherError):
    """A checkpoint directory that cannot be read or does not describe a supported model."""


class RequestError(TetherError):
    """A generation request that cannot be served (too long, empty, out-of-vocabulary ids)."""


class RolloutStalledError(TetherError, TimeoutError):
    """The rollout side made no progress within its time limit (no group finished, weights not taken):
    the generator is stuck, or a reward function it calls does not return."""


class RunOutputError(TetherError):
    """A run's own files cannot be written (a full disk, the run directory deleted under it)."""
