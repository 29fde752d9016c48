"""vLLM's /metrics page (Prometheus text), read with prometheus_client's own parser."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    name: str                 # the sample's name as exposed (a counter's keeps `_total`)
    labels: dict[str, str]
    value: float


def samples(text: str, prefix: str = "") -> list[Sample]:
    """Every sample on the page whose name starts with `prefix`. A page that does not parse (a proxy's error
    page, a cut-off read) gives the samples before the fault."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith(prefix):
                    out.append(Sample(s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError):
        pass
    return out


def total(text_or_samples: str | list[Sample], name: str) -> float | None:
    """The sum of `name`'s samples over every label set (engines, models, finish reasons); None where the page
    has none."""
    found = samples(text_or_samples, name) if isinstance(text_or_samples, str) else text_or_samples
    values = [s.value for s in found if s.name == name]
    return sum(values) if values else None


__all__ = ["Sample", "samples", "total"]
