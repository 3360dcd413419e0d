"""rlalign's version (a leaf module, so that any layer can record it without importing the package facade)."""

__version__ = "0.6.0"
