"""Run a command-line entry point inside the test process, as a subprocess would see it.

A `recsys-plan` call in a subprocess spends ~4 s of CPU importing torch, torchrec and fbgemm
before it reads its first argument; the suite makes about a hundred such calls. ``run_main`` calls
the module's ``main(argv)`` in this process instead and returns what ``subprocess.run`` would: the
exit code (``sys.exit``, argparse's usage errors and an uncaught exception, which a subprocess
reports as exit 1 with a traceback, included), stdout and stderr. Global state a CLI sets for its
own process (logging level, warnings filters, the working directory) is put back afterwards.

Each CLI keeps at least one test that starts the real console command, so the process-level
contract (the exit status and the one line on stderr) is still checked end to end.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import subprocess
import traceback
import warnings
from pathlib import Path


def run_main(module: str, *args: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``python -m <module> <args>``, run in this process; ``module`` must define ``main(argv)``."""
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    old_cwd = os.getcwd()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=err)
            except Exception:
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(old_cwd)
        logging.disable(logging.NOTSET)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    return subprocess.CompletedProcess([module, *args], code or 0, out.getvalue(), err.getvalue())
