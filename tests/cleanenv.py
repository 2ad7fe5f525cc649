"""Run Python as a user without meshlm would: a fresh interpreter, an environment holding only what
it needs, and meshlm blocked from import, so an artifact (an exported folder, a served model) cannot
lean on the installed package. The block is a `sitecustomize` meta-path finder, first on
`sys.meta_path` from interpreter start: the editable install's path entry stays, but no `import
meshlm...` reaches it. The code runs after a check that the block holds and before one that meshlm
never entered `sys.modules`."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCKER = '''
import sys


class NoMeshlm:
    """Refuses every meshlm module: this interpreter stands for a user who has none."""

    def find_spec(self, name, path=None, target=None):
        if name == "meshlm" or name.startswith("meshlm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)


sys.meta_path.insert(0, NoMeshlm())
'''
PRELUDE = '''
import sys
try:
    import meshlm  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("meshlm is importable: the block did not hold")
'''
EPILOGUE = '''
assert not any(m == "meshlm" or m.startswith("meshlm.") for m in sys.modules), \
    "meshlm entered sys.modules"
print("clean-env ok")
'''


def run_without_meshlm(code: str, tmp_path: Path,
                       timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where meshlm cannot be imported; fails the test unless it
    ends cleanly."""
    blocker = tmp_path / "no-meshlm"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(blocker),
           "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    program = PRELUDE + textwrap.dedent(code) + EPILOGUE
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env,
                          cwd=tmp_path,
                          timeout=timeout)
    assert (proc.returncode == 0
            and proc.stdout.rstrip().endswith("clean-env ok")), proc.stderr[-3000:]
    return proc
