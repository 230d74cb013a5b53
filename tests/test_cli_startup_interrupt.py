"""Ctrl-C while a command-line tool imports jax ends it at once with one line and exit status 130
(``minimax_jax.interrupt.exit_while_starting``). Without it, jax's import swallowed the KeyboardInterrupt
(the run carried on) or broke the extension's start. A meta-path hook delivers SIGINT to the process the
moment ``jax`` is first imported, so the signal lands inside the import every time."""

import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

HOOK = """
import os, runpy, signal, sys
class Hook:
    done = False
    def find_spec(self, name, path=None, target=None):
        if name == "jax" and not Hook.done:
            Hook.done = True
            print("handler during import:", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Hook())
script, sys.argv = sys.argv[1], sys.argv[1:]
if script.startswith("-m"):
    runpy.run_module(script[2:], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(script, run_name="__main__")
print("the tool carried on", flush=True)
"""


@pytest.mark.parametrize("tool,prog", [("infer.py", "infer.py"), ("train.py", "train.py"),
                                       ("-mminimax_jax.serve", "python -m minimax_jax.serve"),
                                       ("-mminimax_jax.eval", "python -m minimax_jax.eval")])
def test_ctrl_c_while_importing_jax_exits_at_once(tool, prog):
    script = tool if tool.startswith("-m") else os.path.join(REPO_ROOT, tool)
    r = subprocess.run([sys.executable, "-c", HOOK, script, "--help"], capture_output=True, text=True,
                       timeout=300, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu"))
    assert r.returncode == 130, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "handler during import: False" in r.stdout and "carried on" not in r.stdout, r.stdout[-2000:]
    assert r.stderr.strip().splitlines() == [f"{prog}: interrupted (Ctrl-C)"], r.stderr[-2000:]
