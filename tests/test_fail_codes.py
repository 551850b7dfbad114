"""Every failure code the kernels and the NCCL link record (``FailCode`` in ffi/kernels/launch.h) has its own
message in ``DeviceResources::Failure`` (ffi/runtime/group.cc) and its row in docs/cuda_backend.md's table of codes.
Static: runs without a GPU or the extension."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail_codes() -> dict[str, int]:
    header = (ROOT / "ffi/kernels/launch.h").read_text()
    body = re.search(r"enum FailCode : int32_t \{(.*?)\};", header, re.S)
    assert body, "FailCode not found in launch.h"
    return {name: int(value) for name, value in re.findall(r"^\s*(k\w+) = (\d+),", body.group(1), re.M)}


def test_failure_codes_are_distinct_and_ok_is_zero():
    codes = fail_codes()
    assert codes.get("kOk") == 0
    assert len(set(codes.values())) == len(codes), codes
    assert {"kMissingPeer", "kNcclTimeout", "kNcclFailed"} <= set(codes)


def test_every_failure_code_has_a_message_and_a_documented_meaning():
    failure = (ROOT / "ffi/runtime/group.cc").read_text()
    start = failure.index("std::string DeviceResources::Failure() const")
    body = failure[start : failure.index("\n}\n", start)]
    handled = set(re.findall(r"case (k\w+):", body))
    documented = set(re.findall(r"^\| `(k\w+)` \|", (ROOT / "docs/cuda_backend.md").read_text(), re.M))
    codes = set(fail_codes()) - {"kOk"}
    assert codes - handled == set(), "codes without a message in DeviceResources::Failure"
    assert codes - documented == set(), "codes without a row in docs/cuda_backend.md"
    assert handled - codes == set() and documented - codes == set(), "messages or rows of codes that do not exist"
