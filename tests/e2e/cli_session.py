"""Run several ``specbatch`` command lines in one process, loading each model once.

    python tests/e2e/cli_session.py JOBS.json

JOBS.json: ``[{"args": [...], "stdout": PATH, "stderr": PATH}, ...]``. Each job goes through
``specbatch.cli.main`` exactly as the ``specbatch`` script runs it, with file descriptors 1 and 2
sent to its own files; an exception that escapes ``main`` is printed as the interpreter would
(a traceback, exit status 1). The exit statuses are written to ``JOBS.json.rc``. The only
difference from separate processes: ``load_model`` remembers what it loaded.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback


def run_one(main, args: list[str], stdout: str, stderr: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                main(args, prog_name="specbatch")
                rc = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    rc = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    rc = 1
            except BaseException:  # what the interpreter prints for an uncaught exception
                traceback.print_exc()
                rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return rc


def main() -> None:
    from specbatch.cli import main as cli_main
    from specbatch.models import loader

    loader.load_model = functools.lru_cache(maxsize=None)(loader.load_model)
    jobs_path = sys.argv[1]
    with open(jobs_path) as f:
        jobs = json.load(f)
    codes = [run_one(cli_main, j["args"], j["stdout"], j["stderr"]) for j in jobs]
    with open(jobs_path + ".rc", "w") as f:
        json.dump(codes, f)


if __name__ == "__main__":
    main()
