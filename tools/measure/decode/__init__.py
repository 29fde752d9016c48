"""Decode speed: its parameters (params), one run against a server (run), the drafter table over owned servers (sweep)."""
