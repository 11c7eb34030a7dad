"""A worker for tests/integration/support/test_worker_zygote.py: says who it is, then exits with
the code it is given, or waits for a signal."""

import json
import os
import sys
import time

seen = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd()}
print(json.dumps({**seen, "probe": os.environ.get("PROBE"), "hash": hash("probe")}), flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
