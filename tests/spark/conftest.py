"""The Spark tests share their helpers through sparkhelpers.py (a module named
``conftest`` would clash with tests/conftest.py on import). Each test module starts one
Spark session (module-scoped fixture); without pyspark or Java the modules are skipped,
with the reason."""
