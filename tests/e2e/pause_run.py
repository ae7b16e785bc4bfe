"""``specbatch`` that stops dead at a chosen point, for a test to SIGKILL it there.

    python tests/e2e/pause_run.py POINT MARKER specbatch-args...

POINT:
    after:N   right after the N-th finished record is appended to the work file
    torn:N    halfway through writing the N-th record's line (as if the kill hit that write)
    final     inside the final write: OUT is complete in its temp file, not yet renamed
              (the command line must give the output as ``-o OUT``)
When it gets there it creates the file MARKER and sleeps until killed. Everything else is the
real command line (``specbatch.cli.main``) with the real writer.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def pause(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def main() -> None:
    import orjson

    from specbatch.cli import main as cli_main
    from specbatch.io import writer

    point, marker, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    kind, _, n = point.partition(":")
    if kind in ("after", "torn"):
        num = int(n)
        write = writer.OutputWriter.write
        count = 0

        def paused_write(self, index, out, schedule=None):
            nonlocal count
            if kind == "torn" and count + 1 == num:
                item = {"index": index, "record": out}
                if schedule is not None:
                    item["schedule"] = schedule
                line = orjson.dumps(item, option=writer.JSON_OPTIONS)
                self._fh.write(line[:len(line) // 2])
                self._fh.flush()
                pause(marker)
            is_new = write(self, index, out, schedule)
            count += is_new
            if kind == "after" and count == num:
                pause(marker)
            return is_new

        writer.OutputWriter.write = paused_write
    elif kind == "final":
        out = Path(args[args.index("-o") + 1]).resolve()
        replace = os.replace

        def paused_replace(src, dst, **kw):
            if Path(dst).resolve() == out:
                pause(marker)
            return replace(src, dst, **kw)

        writer.os.replace = paused_replace  # ``writer.os`` is the os module: this process only
    else:
        raise SystemExit(f"unknown point {point!r}")
    cli_main(args, prog_name="specbatch")


if __name__ == "__main__":
    main()
