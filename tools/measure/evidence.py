"""An evidence folder: one run of a measurement, kept so that every figure can be checked and traced.

Layout of `<out>/<run-id>/`: `raw/<name>.json` (one record per prompt, cell or repeat), `summary.json` (the
operation's result model), `summary.md` (its table), `provenance.json` (tools.measure.provenance, with the
server's argv). The folder is built as `<out>/.<run-id>.partial-PID-START-RAND/` and renamed into place by
`finish()`: a run stopped anywhere (a signal, a kill, a full disk) leaves no folder that looks complete, and the
next run in `<out>` removes what a run whose process is gone left (tools.core.atomic_files). Every file is
written through a temporary name and renamed; a path that cannot be written is one line naming it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tools.core.atomic_files import TempFolder, refusal, write_file
from tools.core.errors import ToolFailure
from tools.core import clock
from tools.core.names import check_name
from tools.measure import provenance as prov_mod
from tools.serving.config import ServeConfig

def write_json(path: str | Path, data: Any) -> Path:
    """Atomic JSON write (tools.core.atomic_files.write_file); one line naming the path when it cannot be
    written."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    return write_file(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: str | Path, text: str) -> Path:
    return write_file(path, text)


def write_texts(*files: tuple[Path, str]) -> None:
    """Write each file whole, all or none: a failed write puts the files already replaced back as they were."""
    done: list[tuple[Path, bytes | None]] = []
    try:
        for f, text in files:
            old = f.read_bytes() if f.is_file() else None
            write_file(f, text)
            done.append((f, old))
    except BaseException:
        for f, old in reversed(done):
            try:
                if old is None:
                    f.unlink(missing_ok=True)
                else:
                    write_file(f, old)
            except (OSError, ToolFailure):
                pass  # the first failure is the one to report
        raise


def run_id(kind: str, label: str | None = None, digest: str | None = None) -> str:
    """Every run folder's name, `<kind>-<UTC stamp>[-<label>][-<digest>]`: sorted by time within a kind, named for
    what it measured; `digest`: of the parameters, for a run that a later one resumes or compares."""
    return "-".join([kind, clock.stamp()] + [part for part in (label, digest) if part])


def run_digest(identity: Any) -> str:
    """A run id's `digest`: 8 hex digits of the sha256 of what identifies the run's parameters, as sorted JSON (the
    same parameters, the same digest: how a later run finds the one it resumes or compares)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


class EvidenceRun:
    """A run folder being written. Use `create`, write records, then `finish` (or `abandon` on failure)."""

    def __init__(self, out: Path, name: str, folder: TempFolder) -> None:
        self.out = out
        self.name = name
        self.final = out / name
        self._folder = folder
        self.dir = folder.path
        self.raw = self.dir / "raw"

    @classmethod
    def create(cls, out: str | Path, name: str) -> "EvidenceRun":
        """The run's temporary folder `<out>/.<name>.partial-...`; the ones of runs whose process is gone are
        removed first. Where `name` is taken (a folder, or a run started in the same second) the run is named
        `name-2`, `name-3`, ... (tools.core.atomic_files.TempFolder): `name` and `path` say which."""
        check_name(name, what="run id")
        folder = TempFolder.open(out, name)
        run = cls(Path(out), folder.final.name, folder)
        try:
            run.raw.mkdir()
        except OSError as exc:
            folder.discard()
            raise refusal(run.raw, exc, "create") from None
        return run

    @property
    def path(self) -> Path:
        """Where the folder will be once finished (what results report)."""
        return self.final

    def write_raw(self, name: str, record: Any) -> Path:
        return write_json(self.raw / f"{check_name(name, what='record name')}.json", record)

    def write_summary(self, result: BaseModel | dict[str, Any], markdown: str) -> dict[str, str]:
        write_json(self.dir / "summary.json", result)
        write_text(self.dir / "summary.md", markdown)
        return {"summary_json": str(self.final / "summary.json"), "summary_md": str(self.final / "summary.md")}

    def write_provenance(self, base_url: str | None, *, serve_config: ServeConfig | None = None,
                         server_argv: list[str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """provenance.json: collect() for base_url, the given argv where the caller started the server itself,
        plus extra fields (e.g. the speculative config). Returns what was written."""
        prov = collect_provenance(base_url, serve_config=serve_config, server_argv=server_argv)
        data = prov.to_dict()
        data.update(extra or {})
        write_json(self.dir / "provenance.json", data)
        return data

    def finish(self) -> Path:
        return self._folder.publish()

    def abandon(self) -> None:
        self._folder.discard()


def collect_provenance(base_url: str | None, *, serve_config: ServeConfig | None = None, server: Any = None,
                       server_argv: list[str] | None = None) -> prov_mod.Provenance:
    """provenance.collect, with the argv given by a caller that started the server (it knows it for sure)."""
    prov = prov_mod.collect(base_url, serve_config=serve_config, server=server)
    if server_argv:
        prov.server_argv = list(server_argv)
        prov.notes = [n for n in prov.notes if "argv unknown" not in n]
        if prov.checkpoint_config_sha256 is None and "--model" in prov.server_argv:
            model = prov.server_argv[prov.server_argv.index("--model") + 1]
            if Path(model).is_dir():
                prov.checkpoint_config_sha256 = prov_mod.config_sha256(model)
                prov.checkpoint_config_path = str(Path(model) / "config.json")
    return prov


def argv_option(argv: list[str] | None, flag: str) -> str | None:
    """The value after `flag` in an argv (`--flag value` or `--flag=value`), or None."""
    if not argv:
        return None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
