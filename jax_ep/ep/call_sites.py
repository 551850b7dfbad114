"""Call sites: a 16-bit id per jax_ep op in the calling code, the same on every rank, which backend "cuda" puts
in the tag of each of the op's calls. Ranks that reach different jax_ep calls at the same position (different
branches of a ``lax.cond`` on a rank-local value) then fail when they meet, instead of pairing their data.

The id hashes the op's name, what its data's layout depends on (its operands' shapes and dtypes, the dispatch's
configuration), and the code that called it: the file name, function and line of every frame outside jax and
jax_ep, from the op out to the nearest function that JAX traces (a jitted function, a ``shard_map`` or ``scan``
body, a ``cond`` branch, ...). The frames beyond that trace, which differ with where the traced function was first
called from, take no part. Two calls of one shape from the same lines (layers of a Python loop) share a site;
ranks that swap such calls still pair them by position. Calls of other shapes from one line (a function jitted for
two batch sizes, whose executables two processes run in another order) fail when they meet.
"""

from __future__ import annotations

import hashlib
import os
import sys

import jax

_JAX_EP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is jax_ep/ep/call_sites.py
_LIBRARIES = (os.path.dirname(os.path.abspath(jax.__file__)) + os.sep, _JAX_EP + os.sep)
# Where JAX calls the function it traces: trace_to_jaxpr, trace_to_jaxpr_dynamic (jax 0.10-0.11),
# trace_to_jaxpr_nocache (0.12).
_TRACE_ENTRY = "trace_to_jaxpr"
_described: dict[int, str] = {}


def _in_library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LIBRARIES)


def site(op: str, *shape: object, operands: str = "") -> int:
    """The call site of op ``op`` called by the code that called the public jax_ep function now running; ``shape``:
    what its data's layout depends on, alike on every rank that runs the same call; ``operands``: a short form of it
    for the site's description."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _in_library(code.co_filename):
            frames.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        elif code.co_name.startswith(_TRACE_ENTRY):
            break
        frame = frame.f_back
    number = derive(op, *shape, *frames)
    where = f" at {frames[0].replace(':', ' in ', 1).replace(':', ', line ', 1)}" if frames else ""
    _described.setdefault(number, f"{op}{where}" + (f" ({operands})" if operands else ""))
    return number


def derive(*parts: object) -> int:
    """A 16-bit site from ``parts``: the site of a call that belongs to another (a backward pass), or a new one."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little")


def backward(number: int, what: str) -> int:
    """The site of the backward pass (``what`` of it) of the op at site ``number``."""
    derived = derive(number, what)
    _described.setdefault(derived, f"{what} of {describe(number)}")
    return derived


def describe(number: int) -> str:
    """Where this process traced the op at site ``number``, or that it did not."""
    return _described.get(number, "traced by no code of this process")
