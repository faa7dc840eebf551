"""The one place the version lives (setup.py reads it with a regex, fastdp imports it)."""

__version__ = "0.1.0"
