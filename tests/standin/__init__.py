"""FoundationDB's official Python binding over a stand-in for its C library.

``install()`` makes the next ``import fdb.impl`` (``fdb.api_version``) load
:class:`standin.libfdb_c.Library` where it would load ``libfdb_c.so``; the binding's
Python code is FoundationDB's own, unchanged. The suite's ``fdb`` pass
(``FDQ_TEST_ENGINE=fdb``, see ``tests/conftest.py``) installs it in the test process and,
through ``site/sitecustomize.py`` on ``PYTHONPATH``, in every process a test starts.
"""
from __future__ import annotations

import ctypes
import os
import sys

from .libfdb_c import Library, modes_from_env, write_cluster_file

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
_library = None


def install(*, ffi: bool = True, network: bool = True, strict: bool = True, max_api_version: int | None = None):
    """Load the binding over the stand-in (once per process); returns the Library."""
    global _library
    if _library is not None:
        return _library
    if "fdb.impl" in sys.modules:
        raise RuntimeError("fdb.impl is already loaded: install the libfdb_c stand-in before fdb.api_version")
    kwargs = {} if max_api_version is None else {"max_api_version": max_api_version}
    lib = Library(ffi=ffi, network=network, strict=strict, **kwargs)
    real = ctypes.CDLL

    class CDLL(real):
        def __new__(cls, name, *args, **kwargs):
            if "fdb_c" in os.path.basename(str(name)):
                return lib
            return super().__new__(cls)

    if network:
        # A real client's network thread runs without the GIL; this one is Python, and
        # every operation is a hand-off to it and back. At the default 5 ms switch
        # interval, busy client threads hold it off for that long per operation.
        sys.setswitchinterval(0.0005)
    ctypes.CDLL = CDLL
    try:
        import fdb.impl  # noqa: F401 - the binding's module, loading the stand-in
    finally:
        ctypes.CDLL = real
    _library = lib
    return lib


def install_from_env():
    """``$FDQ_STANDIN`` (see :func:`standin.libfdb_c.modes_from_env`); ``$FDQ_STANDIN_MAX_API``
    plays an older client library."""
    max_api = os.environ.get("FDQ_STANDIN_MAX_API")
    return install(**modes_from_env(), max_api_version=int(max_api) if max_api else None)


def environment(env: dict | None = None, modes: str = "ffi,network,strict") -> dict:
    """``env`` (default: this process's) with what makes a child process load the stand-in."""
    env = dict(os.environ if env is None else env)
    env["FDQ_STANDIN"] = modes
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + paths)
    return env


__all__ = ["install", "install_from_env", "environment", "write_cluster_file", "Library", "SITE_DIR"]
