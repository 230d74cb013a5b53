"""Paths the tests share."""

import os

#: The repository root (the folder holding ``tests/``).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
