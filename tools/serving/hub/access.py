"""The Hugging Face hub as the deployment meets it: the source checkpoint's repo, the token and the environment
a fetch uses, and the hub's errors in one line with what to do."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from repack.source.checks import SOURCE_REPO
from tools.core.errors import BadInput, ToolFailure, op
from tools.core.text import clip


def hf_token() -> tuple[str | None, str]:
    """(token, where it came from) without printing it: HF_TOKEN, else huggingface_hub's token file."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"], "HF_TOKEN"
    try:
        from huggingface_hub import get_token  # heavy, and only needed without HF_TOKEN

        tok = get_token()
    except Exception:  # an unreadable token file is the same as none here
        tok = None
    return (tok, "the huggingface_hub token file") if tok else (None, "")


def hub_env() -> tuple[str | None, str, bool]:
    """(endpoint, cache dir, offline), read now: huggingface_hub reads them once, at import."""
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if endpoint is not None:
        try:
            url = urlsplit(endpoint)
            ok = url.scheme in ("http", "https") and bool(url.hostname)
        except ValueError:  # an unclosed [ipv6 bracket, say
            ok = False
        if not ok:
            raise BadInput(f"HF_ENDPOINT={clip(endpoint, 80)!r} is not an http(s) URL: set it to the hub's address "
                           f"(e.g. https://huggingface.co) or unset it", detail={"HF_ENDPOINT": clip(endpoint, 200)})
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]).expanduser() / "hub") if os.environ.get("HF_HOME") else None)
    if cache is None:
        from huggingface_hub import constants

        cache = constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return endpoint, str(Path(cache).expanduser()), offline


def hub_failure(exc: BaseException, repo_id: str, revision: str, endpoint: str | None, has_token: bool) -> ToolFailure:
    """huggingface_hub's exception as one line naming the fix (gated, not found, offline, cut off, ...)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    page = f"https://huggingface.co/{repo_id}"
    token_fix = (f"accept the licence at {page} with the account of your token (HF_TOKEN)" if has_token else
                 f"accept the licence at {page} and export HF_TOKEN=<a read token of that account>")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    detail = {"repo_id": repo_id, "revision": revision, "endpoint": endpoint, "status": status,
              "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    if isinstance(exc, GatedRepoError) or status == 403 or (status == 401 and not isinstance(
            exc, RepositoryNotFoundError)):
        who = "this token has no access" if has_token else "this machine has no Hugging Face token"
        return ToolFailure(f"{repo_id} is gated and {who} (HTTP {status}): {token_fix}, then run the fetch again",
                           detail={**detail, "kind": "gated"})
    if isinstance(exc, RevisionNotFoundError):
        return ToolFailure(f"revision {revision!r} not found in {repo_id}: pass a branch, tag or commit of {page}",
                           detail={**detail, "kind": "revision"})
    if isinstance(exc, RepositoryNotFoundError):
        return ToolFailure(f"repo {repo_id} not found{'' if has_token else ' (or private/gated, and no token is set)'}"
                           f": check the id at {page}" + ("" if has_token else "; if it is gated, " + token_fix),
                           detail={**detail, "kind": "repo"})
    if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)):
        return ToolFailure(f"{repo_id}@{revision} is not complete in the huggingface_hub cache and the hub cannot be "
                           "reached (HF_HUB_OFFLINE=1 or no network): connect and unset HF_HUB_OFFLINE, then run the "
                           f"fetch again; without the hub, {op('tiny_model')} makes a stand-in source to walk the "
                           "pipeline with", detail={**detail, "kind": "offline"})
    name = type(exc).__name__
    if "Protocol" in name or "ReadError" in name or "Consistency check failed" in str(exc):
        return ToolFailure(f"the download from {endpoint or 'https://huggingface.co'} was cut off ({name}); run the "
                           "fetch again: it resumes from what the huggingface_hub cache already holds",
                           detail={**detail, "kind": "dropped"})
    if "Connect" in name or "Timeout" in name or "Network" in name or isinstance(exc, ConnectionError):
        return ToolFailure(f"no network: cannot reach {endpoint or 'https://huggingface.co'} ({name}); check the "
                           f"connection, a proxy or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use what is cached; without "
                           f"the hub, {op('tiny_model')} makes a stand-in source to walk the pipeline with",
                           detail={**detail, "kind": "network"})
    if isinstance(exc, HfHubHTTPError):
        return ToolFailure(f"the hub answered HTTP {status} for {repo_id}@{revision}: try again later",
                           detail={**detail, "kind": "http"})
    return ToolFailure(f"fetching {repo_id}@{revision} failed ({name}: {str(exc).splitlines()[0] if str(exc) else ''})",
                       detail={**detail, "kind": "other"})


__all__ = ["SOURCE_REPO", "hf_token", "hub_env", "hub_failure"]
