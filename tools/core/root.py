"""The checkout's root folder: tpu.env, models/, evidence/ and run/ are found from here."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
