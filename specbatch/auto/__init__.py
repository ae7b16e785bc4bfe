"""``--method auto``: plan the job, then choose each row's draft every step.

- ``predict``: a record's draft acceptance predicted from its prompt alone.
- ``costmodel``: the machine's measured step cost (``specbatch calibrate``), fixed for a job.
- ``journal``: the per-step decisions a resumed job replays.
- ``planner``: buckets records by predicted acceptance, orders them, prints the plan, and builds
  the policy (``plan_auto``).
- ``candidate``: the ``Candidate`` protocol (a proposer with per-position confidence, a cost
  per step and an acceptance pool) and the built-in candidates: prompt lookup, the draft model,
  suffix drafts.
- ``policy``: ``AdaptivePolicy``, one selection loop over the candidates.
- ``proposer``: ``AutoProposer``, the one proposer the engine sees.

Which methods auto may choose is in the registry (``methods.Method.auto`` and ``.candidate``).
Outputs never depend on any of it: only which drafts are verified does.
"""
