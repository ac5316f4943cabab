"""The package's version, in a module of its own: audit.py, the policy builder and the command line read it from
here, so that no module imports the package's face (precision_audit/__init__.py) for it."""

__version__ = "0.1.0"
