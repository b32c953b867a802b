"""Cheap, always-on detection: the fused per-step sentinel and adaptive detectors."""
