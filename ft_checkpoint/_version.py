"""The installed version (``pyproject.toml``'s: a test keeps the two equal), where the layers record it (a manifest's
``versions``, ``ft-checkpoint --version``) without importing the package's public names.

Example:
    >>> __version__.count(".") >= 2
    True
"""

__version__ = "0.2.0.dev0"
