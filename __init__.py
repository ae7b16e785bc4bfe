"""Not part of the package: this file makes a checkout in a folder named ``specbatch`` import
as the package from the folder that holds it.

Run from that parent folder (``cd ~/src && python job.py``, with the checkout at
``~/src/specbatch/``), ``import specbatch`` finds the checkout's own folder first on
``sys.path``. Without this file Python took that folder as a namespace package (no code, so
``from specbatch import LLM`` failed with "cannot import name 'LLM' ... (unknown location)"),
even with the checkout installed (``pip install -e .``: the editable finder is asked only after
the path). Here the import hands over to the real package, ``specbatch/specbatch/``, which
replaces this module in ``sys.modules`` (the import system returns what ``sys.modules`` holds
after the module ran). Imported under any other name (a checkout named otherwise), it does
nothing.
"""

if __name__ == "specbatch":
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _inner = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "specbatch")
    _spec = _util.spec_from_file_location("specbatch", _os.path.join(_inner, "__init__.py"),
                                          submodule_search_locations=[_inner])
    _module = _util.module_from_spec(_spec)
    _sys.modules["specbatch"] = _module
    _spec.loader.exec_module(_module)
