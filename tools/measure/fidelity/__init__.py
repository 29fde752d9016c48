"""Fidelity against a reference: the reference and corpus files (files), the record and compare runs (run)."""
