"""Run GPU test files and record each test's outcome as JSON with its provenance.

python bench/gpu_tests.py OUT.json tests/test_cuda_layout.py [more pytest args]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest

from jax_ep.bench.record import provenance, write


def main() -> int:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    with TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        status = pytest.main([*args, "-v", f"--junitxml={junit}"])
        cases = []
        for case in ET.parse(junit).iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
            cases.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome,
                    "seconds": float(case.get("time", 0)),
                }
            )
    summary = {kind: sum(c["outcome"] == kind for c in cases) for kind in ("passed", "failure", "error", "skipped")}
    write(
        out,
        {**provenance("python " + " ".join(sys.argv)), "pytest_exit": int(status), "summary": summary, "tests": cases},
    )
    print(summary)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
