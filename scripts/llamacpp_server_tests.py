"""llama.cpp's own server test suite (tools/server/tests/unit in the llama-cpp-python 0.3.36 source
archive) run against `jinfer serve`, in the suite's external-server mode: which of its tests pass,
and why the others fail (the first line of each failure).

The suite's requirements go into a virtual environment of their own (results/.llamacpp-tests-venv),
jinfer serves the embedded model (or --model) on --port, and pytest runs the chosen files with
DEBUG_EXTERNAL=1. Many of its tests exercise llama.cpp-only endpoints (/completion, /slots,
/props, ...) or texts of llama.cpp's own test models; this script reports, it does not judge.
The OpenAI-shaped ones are ported in tests/test_llamacpp_suite.py, which says of every test of
these files where jinfer checks its property or why it does not apply.

    python scripts/llamacpp_server_tests.py [--files unit/test_chat_completion.py,...] [--out results]

Writes results/llamacpp_server_tests.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ElementTree

from benchlib import llama_cpp_source, markdown_table, progress, write_results

FILES = (
    "unit/test_chat_completion.py,unit/test_completion.py,unit/test_tool_call.py,"
    "unit/test_compat_oai_responses.py,unit/test_basic.py,unit/test_stream.py,"
    "unit/test_ignore_eos.py,unit/test_security.py,unit/test_tokenize.py"
)
# The suite's requirements.txt, with the versions its tests were written against where they matter.
REQUIREMENTS = [
    "pytest~=8.3",
    "openai~=2.14.0",
    "aiohttp",
    "filelock",
    "numpy",
    "prometheus-client",
    "requests",
    "wget",
]


def suite_python(out: str) -> str:
    venv = os.path.join(out, ".llamacpp-tests-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        progress(f"creating {venv} with the suite's requirements")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    return python


def serve(model: str | None, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "jinfer.cli", "serve", "--port", str(port), "--max-slots", "4"]
    server = subprocess.Popen([*command, *(["--model", model] if model else [])], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.kill()
    raise TimeoutError("jinfer serve did not become ready")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", default=FILES)
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    root = llama_cpp_source(os.path.join(args.out, ".llama-cpp-source"), ("tools/server/tests/",))
    tests = os.path.join(root, "tools", "server", "tests")
    python = suite_python(args.out)
    report = os.path.abspath(os.path.join(args.out, ".llamacpp-server-tests.xml"))
    server = serve(args.model, args.port)
    try:
        env = dict(os.environ, DEBUG_EXTERNAL="1", PORT=str(args.port))
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        subprocess.run([*command, *args.files.split(",")], cwd=tests, env=env, stdout=subprocess.DEVNULL)
    finally:
        server.terminate()
        server.wait(timeout=60)
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = (
            "skipped" if case.find("skipped") is not None else ("failed" if problem is not None else "passed")
        )
        by_file[case.get("classname")][outcome] += 1
        if problem is not None:
            failures.append({"test": name, "why": (problem.get("message") or "").splitlines()[0][:160]})
    rows = [[f, c["passed"], c["failed"], c["skipped"]] for f, c in sorted(by_file.items())]
    result = {"files": {f: dict(c) for f, c in by_file.items()}, "failures": failures}
    table = markdown_table(["file", "passed", "failed", "skipped"], rows)
    table += "\n\n" + markdown_table(["failed test", "first line"], [[f["test"], f["why"]] for f in failures])
    write_results(args.out, "llamacpp_server_tests", result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
