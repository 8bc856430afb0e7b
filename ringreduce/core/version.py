"""ringreduce's release (pyproject.toml's version), on its own so that init() can compare it
across ranks (world.py) below the package that exports it."""
__version__ = "0.1.0"
