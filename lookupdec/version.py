"""The package version, importable from any layer without importing the package's face."""
__version__ = "0.1.0"
