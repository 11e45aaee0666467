"""The package version, in a module of its own: reading it imports nothing else."""

__version__ = "0.1.0"
