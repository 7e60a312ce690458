"""Reading an exposition back with ``prometheus_client``'s own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """The samples of one exposition, by sample name and labels."""

    def __init__(self, text: str) -> None:
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in self.families.values():
            for sample in family.samples:
                self.samples[sample.name, frozenset(sample.labels.items())] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The value of the sample ``name`` with exactly ``labels``.

        :raises KeyError: no such sample was exposed.
        """
        return self.samples[name, frozenset(labels.items())]

    def buckets(self, name: str, **labels: str) -> dict[float, float]:
        """A histogram's cumulative buckets, ``{upper bound: count}`` (``inf`` last)."""
        found = {
            float(dict(key)["le"]): value
            for (sample, key), value in self.samples.items()
            if sample == f"{name}_bucket" and {k: v for k, v in key if k != "le"} == labels
        }
        return dict(sorted(found.items()))
