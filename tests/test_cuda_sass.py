"""The built extension's machine code (cuobjdump -sass) keeps what the protocol's speed rests on: a rank raises
its peers' flags, and relays an abort, with one system-scope fence before the loop over peers, not a fence per
peer (a release store is a fence and a store, so R - 1 NVLink round trips in series)."""

import functools
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from jax_ep.ep import group as _group


def _tool_dir():
    """The folder holding cuobjdump and nvdisasm: PATH, else the nvidia-cuda-cuobjdump wheel's."""
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return pathlib.Path(found).parent
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for tools in pathlib.Path(root).glob("cu*/bin"):
            if (tools / "cuobjdump").exists() and (tools / "nvdisasm").exists():
                return tools
    return None


@functools.cache
def _sass():
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built: {_group.unavailable_reason()}")
    tools = _tool_dir()
    if tools is None:
        pytest.skip("cuobjdump and nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from jax_ep.ep import _jax_ep_cuda

    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        [str(tools / "cuobjdump"), "-sass", _jax_ep_cuda.__file__], capture_output=True, text=True, env=env, check=True
    ).stdout
    return out


_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _functions(sass):
    """{mangled name: [(address, instruction)]}."""
    functions, current = {}, None
    for line in sass.splitlines():
        name = _FUNCTION.search(line)
        if name:
            current = functions.setdefault(name.group(1), [])
            continue
        instruction = _INSTRUCTION.search(line)
        if instruction and current is not None:
            current.append((int(instruction.group(1), 16), instruction.group(2)))
    return functions


def _store_loops(code):
    """The loops (a branch back to a lower address, and what lies between) that store with system scope and neither
    load with it nor use atomics: the flag raise and the abort relay (the polls load)."""
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
        if any(re.search(r"\bSTG\.E\.64\.STRONG\.SYS\b", t) for t in body) and not any(
            re.search(r"\bLDG\S*STRONG\.SYS\b|\b(ATOMG|ATOM|RED)\b", t) for t in body
        ):
            loops.append(body)
    return loops


@pytest.mark.parametrize("kernel", ["DispatchKernel", "CombineKernel", "CombineBackwardKernel"])
def test_peer_store_loops_hold_no_system_fence(kernel):
    functions = {name: code for name, code in _functions(_sass()).items() if kernel in name}
    assert functions, f"no {kernel} in the extension's SASS"
    for name, code in functions.items():
        loops = _store_loops(code)
        assert loops, f"{name}: found no loop of system-scope stores (the flag raise); the check would prove nothing"
        for body in loops:
            fences = [t for t in body if re.search(r"\bMEMBAR\.\w+\.SYS\b", t)]
            assert not fences, f"{name}: a loop over peers fences each store: {fences}"
