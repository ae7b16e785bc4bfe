"""``python -m specbatch ...``: the same command line as ``specbatch ...``."""

from specbatch.cli import main

if __name__ == "__main__":
    main(prog_name="specbatch")
