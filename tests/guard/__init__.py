"""The in-job guard's tests (a package: its conftest must not shadow tests/conftest.py as "conftest")."""
