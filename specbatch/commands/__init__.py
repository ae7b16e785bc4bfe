"""The commands of ``specbatch``, one module each; ``specbatch.cli`` only parses the flags and
calls the module's ``command`` with them (``predict-eval``: ``calibrate.predict_eval_command``),
which returns the exit status.

- ``run``: validate -> load -> generate -> write, with resume and clean interrupts (``run_job``).
- ``bench``: several configurations on the same records, interleaved (``run_bench``).
- ``analyze``: tables, what-if replay and comparison of output files; no torch
  (``run_analyze``; the tables themselves are ``specbatch.analyze``).
- ``calibrate``: ``specbatch calibrate`` (the step-cost fit) and ``specbatch predict-eval``.
- ``common``: what they share: the checks made before anything loads, the thread choice.
"""
