"""Fixtures for every test: one intra-op thread, the tiny config builder, a temporary working directory.

Plain shared data and builders live in helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

# Tiny models are dominated by per-op overhead; extra intra-op threads only add contention.
torch.set_num_threads(1)


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture(autouse=True)
def work_in_a_temporary_directory(tmp_path_factory, monkeypatch):
    """Every test runs in an empty directory of its own: nothing reads or writes the checkout, so the
    README's main job (which leaves runs/default behind) and the test suite run in either order."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
