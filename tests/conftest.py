"""Suite-wide order: the tests marked ``slow`` run first.

pytest-xdist hands tests to its workers in collection order, so a minute-long test
collected last runs alone at the end while the other worker idles; started first, the
short tests fill in around it.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
