"""Diagnosis: from what was observed (and localised) to a cause code, a summary and a fix."""
