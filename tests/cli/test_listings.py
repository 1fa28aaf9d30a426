"""Every listing goes to standard output, so that it can be piped (`accelgen nar methods | grep mask`) with standard
error closed or thrown away: there go only the progress and the logs."""

import json
import os
import subprocess
import sys

import pytest

# (arguments, a text the listing must hold); each runs in one process per way of losing standard error
LISTINGS = [
    (["methods"], "speculative"),
    (["methods", "--markdown"], "| `pld` |"),
    (["methods", "--json"], '"name": "speculative"'),
    (["nar", "methods"], "mask-predict"),
    (["models"], "smollm2-135m"),
    (["--version"], "accelgen "),
]
SEPARATOR = "=== accelgen"

# runs each listing through the command line's own entry point, one after the other, with a line between them
DRIVER = """
import json, sys
from accelgen.cli import app
for arguments in json.loads(sys.argv[1]):
    print("=== accelgen", *arguments, flush=True)
    try:
        app(arguments, prog_name="accelgen")
    except SystemExit as exit:
        print("exit status", exit.code, flush=True)
"""


def listings_printed(stderr_closed: bool) -> dict[str, str]:
    """{command: its standard output}, standard error thrown away (DEVNULL) or closed in the child (fd 2 closed:
    Python then has no sys.stderr at all)."""
    commands = [arguments for arguments, _ in LISTINGS]
    kwargs = dict(preexec_fn=lambda: os.close(2)) if stderr_closed else dict(stderr=subprocess.DEVNULL)
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], stdout=subprocess.PIPE, text=True,
                          timeout=600, **kwargs)
    assert done.returncode == 0, done.stdout
    sections = done.stdout.split(SEPARATOR)[1:]
    return {" ".join(arguments): section for arguments, section in zip(commands, sections)}


@pytest.mark.skipif(sys.platform == "win32", reason="closes a file descriptor in the child (POSIX)")
@pytest.mark.parametrize("stderr_closed", [False, True], ids=["stderr-devnull", "stderr-closed"])
def test_listings_go_to_stdout(stderr_closed):
    printed = listings_printed(stderr_closed)
    for arguments, expected in LISTINGS:
        output = printed[" ".join(arguments)]
        assert expected in output, f"`accelgen {' '.join(arguments)}` printed no listing on stdout:\n{output}"
        assert "exit status" not in output or "exit status 0" in output or "exit status None" in output
    methods = json.loads(printed["methods --json"].split("\n", 1)[1].rsplit("exit status", 1)[0])
    assert any(method["name"] == "pld" for method in methods)
