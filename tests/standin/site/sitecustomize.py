"""Loaded at the start of every Python process that has this folder on ``PYTHONPATH``:
with ``$FDQ_STANDIN`` set, FoundationDB's binding loads the libfdb_c stand-in
(``tests/standin``) instead of the real client library."""
import os
import sys

if os.environ.get("FDQ_STANDIN"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import standin

    standin.install_from_env()
