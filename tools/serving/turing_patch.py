"""The Turing clamp for vLLM's Triton unified attention (Tesla T4, compute capability 7.5).

Gemma 4's 512-wide attention heads make `kernel_unified_attention` ask for up to 96 KiB of shared memory
against Turing's 64 KiB ("out of resource: shared memory, Required: 98304, Hardware limit: 65536"). The clamp
inserts, right after vLLM picks its tile sizes: on a device of capability < 8, halve the prefill and decode
TILE_SIZE (never below 16) while (BLOCK_M + 2*TILE) * head_size * element_size exceeds ~60000 bytes, and launch
with num_stages=1. Devices of capability >= 8 run the file's original code path.

The patch is a marked block inserted at one anchor; the original file is backed up next to it. Applying twice,
checking and reverting are safe; a file without the expected anchor (another vLLM version) is refused.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.core.errors import ToolFailure

RELATIVE_PATH = Path("v1/attention/ops/triton_unified_attention.py")
BEGIN = "    # >>> gemma4-t4 turing clamp (patch_triton_turing.py) >>>\n"
END = "    # <<< gemma4-t4 turing clamp <<<\n"
BACKUP_SUFFIX = ".gemma4-t4.orig"

# The clamp goes after the last tile-size adjustment vLLM 0.29-0.32 makes and before the launch kwargs are built.
ANCHOR = (
    "    if use_td:\n"
    "        TILE_SIZE_PREFILL = min(TILE_SIZE_PREFILL, block_size)\n"
    "        TILE_SIZE_DECODE = min(TILE_SIZE_DECODE, block_size)\n"
)
# Names the clamp relies on; each must appear in the file before the anchor or in the launch code after it.
REQUIRED = ("BLOCK_M = (", "launch_num_stages: int | None = None", "launch_kwargs[\"num_stages\"] = launch_num_stages",
            "tile_size = TILE_SIZE_PREFILL", "tile_size = TILE_SIZE_DECODE", "current_platform")

CLAMP = BEGIN + (
    "    # Turing (sm_7x) has 64 KiB of shared memory per block; head_size 512 tiles need up to 96 KiB.\n"
    "    _cap = current_platform.get_device_capability()\n"
    "    if _cap is not None and _cap.major < 8:\n"
    "        _elem = q.element_size()\n"
    "        while TILE_SIZE_PREFILL > 16 and (BLOCK_M + 2 * TILE_SIZE_PREFILL) * head_size * _elem > 60000:\n"
    "            TILE_SIZE_PREFILL //= 2\n"
    "        while TILE_SIZE_DECODE > 16 and (BLOCK_M + 2 * TILE_SIZE_DECODE) * head_size * _elem > 60000:\n"
    "            TILE_SIZE_DECODE //= 2\n"
    "        launch_num_stages = 1\n"
) + END


@dataclass
class PatchStatus:
    target: str
    applied: bool
    backup: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def installed_target() -> Path:
    """The file in the vLLM this interpreter imports (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ToolFailure("vLLM is not installed in this Python; run ./setup.sh, or pass --target FILE")
    return Path(list(spec.submodule_search_locations)[0]) / RELATIVE_PATH


def _target(target: str | Path | None) -> Path:
    path = Path(target) if target is not None else installed_target()
    if not path.is_file():
        raise ToolFailure(f"{path} does not exist; this vLLM has no Triton unified attention to patch")
    return path


def _backup(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def _is_applied(text: str) -> bool:
    """Applied means the exact clamp block sits right after the anchor, once."""
    return text.count(BEGIN) == 1 and (ANCHOR + CLAMP) in text


def check(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    text = path.read_text()
    backup = _backup(path)
    if _is_applied(text):
        return PatchStatus(str(path), True, str(backup) if backup.exists() else None, f"Turing clamp applied in {path}")
    if BEGIN in text or END in text:
        return PatchStatus(str(path), False, str(backup) if backup.exists() else None,
                           f"{path} holds a modified or partial Turing clamp; run --revert, then apply again")
    return PatchStatus(str(path), False, None, f"Turing clamp not applied in {path}")


def apply(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    text = path.read_text()
    if _is_applied(text):
        return check(path)
    if BEGIN in text or END in text:
        raise ToolFailure(f"{path} holds a modified or partial Turing clamp; run --revert first")
    missing = [r for r in REQUIRED if r not in text]
    if text.count(ANCHOR) != 1 or missing:
        what = "the tile-size anchor" if text.count(ANCHOR) != 1 else ", ".join(repr(m) for m in missing)
        raise ToolFailure(f"{path} does not contain the code the Turing clamp expects ({what} not found): "
                          "another vLLM version; pin the vLLM in pyproject.toml or update tools/serving/turing_patch.py")
    backup = _backup(path)
    if not backup.exists():
        shutil.copy2(path, backup)
    new = text.replace(ANCHOR, ANCHOR + CLAMP, 1)
    tmp = path.with_name(path.name + ".gemma4-t4.tmp")
    tmp.write_text(new)
    shutil.copymode(path, tmp)
    tmp.replace(path)  # never a half-written module
    status = check(path)
    if not status.applied:  # pragma: no cover - guards against a broken constant above
        raise ToolFailure(f"{path}: the clamp was written but does not verify; restore {backup}")
    return PatchStatus(status.target, True, str(backup), f"Turing clamp applied to {path} (original: {backup})")


def revert(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    text = path.read_text()
    backup = _backup(path)
    if BEGIN not in text and END not in text:
        backup.unlink(missing_ok=True)
        return PatchStatus(str(path), False, None, f"{path} is not patched; nothing to revert")
    if backup.exists() and BEGIN not in backup.read_text():
        shutil.copy2(backup, path)
        backup.unlink()
        return PatchStatus(str(path), False, None, f"restored {path} from its backup")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ToolFailure(f"{path}: the clamp markers are damaged and no backup exists; reinstall vLLM")
    path.write_text(text[:start] + text[end + len(END):])
    return PatchStatus(str(path), False, None, f"removed the Turing clamp from {path}")
