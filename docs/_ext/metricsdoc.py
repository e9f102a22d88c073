"""``.. metrics-table::`` and ``.. span-attributes::``: the observability tables, made from the code.

The metrics come from :data:`spindle.frontend.grpc.metrics.METRICS` (the list the server builds its metrics from), the
span attributes from :data:`spindle.frontend.grpc.tracing.SPAN_ATTRIBUTES`, so the tables cannot fall behind the code.
Neither module imports prometheus_client or OpenTelemetry at import time, so the docs build needs neither.
"""

from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _bounds(buckets: tuple[float, ...]) -> str:
    """A histogram's buckets in a few words."""
    if not buckets:
        return "1, 2, 5, 10, 20, 50, ... up to the model's context length"
    return f"{len(buckets)} from {buckets[0]:g} to {buckets[-1]:g}"


def metric_rows() -> list[tuple[str, str, str, str]]:
    """``(name as scraped, type, labels, meaning)`` for every metric the server exports."""
    from spindle.frontend.grpc.metrics import METRICS

    rows = []
    for spec in METRICS:
        meaning = spec.help
        if spec.kind == "histogram":
            meaning += f" Buckets: {_bounds(spec.buckets)}."
        if spec.source == "engine":
            meaning += " Read from the engine at each scrape."
        rows.append((spec.sample_name, spec.kind, ", ".join(spec.labels), meaning))
    return rows


class MetricsTable(SphinxDirective):
    """The table of the server's Prometheus metrics (:func:`metric_rows`)."""

    def run(self) -> list:
        """Build the table's reStructuredText and parse it in place."""
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 34 10 16 40", ""]
        lines += ["   * - metric", "     - type", "     - labels", "     - meaning"]
        for name, kind, labels, meaning in metric_rows():
            lines += [f"   * - ``{name}``", f"     - {kind}", f"     - ``{labels}``", f"     - {meaning}"]
        return self.parse_text_to_nodes("\n".join(lines))


class SpanAttributes(SphinxDirective):
    """The table of a request span's attributes."""

    def run(self) -> list:
        """Build the table's reStructuredText and parse it in place."""
        from spindle.frontend.grpc.tracing import SPAN_ATTRIBUTES

        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 40 60", ""]
        lines += ["   * - attribute", "     - value"]
        for name, meaning in SPAN_ATTRIBUTES.items():
            lines += [f"   * - ``{name}``", f"     - {meaning}"]
        return self.parse_text_to_nodes("\n".join(lines))


def setup(app: Sphinx) -> dict[str, object]:
    """Register the directives."""
    app.add_directive("metrics-table", MetricsTable)
    app.add_directive("span-attributes", SpanAttributes)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
