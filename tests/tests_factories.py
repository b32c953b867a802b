"""Importable model factories the replay tests record in their bundles."""

from nantrace.demo.model import DemoTransformer


def small_demo() -> DemoTransformer:
    return DemoTransformer(dim=32, layers=2)
