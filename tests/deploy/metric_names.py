"""Which kvsidecar metric names the deploy tree uses, and which ones the daemon exports.

Reusable outside this folder, e.g. against a live daemon's /metrics:

    from prometheus_client.parser import text_string_to_metric_families
    exported = sample_names(text_string_to_metric_families(body))
    assert metric_names_in_deploy() <= exported
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DEPLOY",
    "METRIC_NAME",
    "dashboard_expressions",
    "dashboard_variable_queries",
    "metric_names_in",
    "metric_names_in_deploy",
    "promql_expressions",
    "recorded_names",
    "rule_files",
    "sample_names",
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# A whole identifier starting with kvsidecar_: not a piece of a recording rule's name (those contain ':'),
# not the tail of a longer word.
METRIC_NAME = re.compile(r"(?<![\w:])kvsidecar_[a-z0-9_]+(?![\w:])")

# Sample-name suffixes per metric type, as the Prometheus text format exposes them.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def sample_names(families: Iterable[Any]) -> set[str]:
    """Every sample name the families can expose, from `registry.collect()` or a parsed /metrics text.

    A labelled metric with no children yet has no samples, so names come from each family's type.
    """
    return {family.name + suffix for family in families for suffix in _SUFFIXES[family.type]}


def rule_files() -> list[Path]:
    """Files that hold Prometheus rule groups: plain rule files and PrometheusRule objects."""
    found = sorted((DEPLOY / "prometheus").glob("*.y*ml"))
    for path in sorted((DEPLOY / "kubernetes").rglob("*.y*ml")):
        if any(doc.get("kind") == "PrometheusRule" for doc in _yaml_docs(path)):
            found.append(path)
    return found


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]


def _rule_groups(path: Path) -> Iterator[dict[str, Any]]:
    for doc in _yaml_docs(path):
        if doc.get("kind") == "PrometheusRule":
            yield from doc["spec"]["groups"]
        elif "groups" in doc:
            yield from doc["groups"]


def _rules() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in rule_files():
        for group in _rule_groups(path):
            for rule in group["rules"]:
                yield f"{path.relative_to(DEPLOY)}: {group['name']}/{rule.get('alert') or rule.get('record')}", rule


def recorded_names() -> set[str]:
    """Series the recording rules define."""
    return {rule["record"] for _, rule in _rules() if "record" in rule}


def _dashboards() -> list[Path]:
    return sorted((DEPLOY / "grafana").glob("*.json"))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard query, Grafana variables still in place."""
    found = []
    for path in _dashboards():
        dashboard = json.loads(path.read_text())
        for panel in _panels(dashboard.get("panels", [])):
            for target in panel.get("targets", []):
                if "expr" in target:
                    where = f"{path.name}: panel {panel['id']} {panel.get('title')!r} {target.get('refId')}"
                    found.append((where, target["expr"]))
    return found


def dashboard_variable_queries() -> list[tuple[str, str]]:
    """(where, query) of the dashboards' query variables (label_values(...) and the like)."""
    found = []
    for path in _dashboards():
        for variable in json.loads(path.read_text()).get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                query = variable["query"]
                found.append(
                    (f"{path.name}: ${variable['name']}", query["query"] if isinstance(query, dict) else query)
                )
    return found


def promql_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every rule and dashboard query in the deploy tree."""
    return [(where, rule["expr"]) for where, rule in _rules()] + dashboard_expressions()


def metric_names_in(text: str) -> set[str]:
    """kvsidecar metric names mentioned in one expression or query."""
    return set(METRIC_NAME.findall(text))


def metric_names_in_deploy() -> set[str]:
    """Every kvsidecar sample name that deploy/prometheus and deploy/grafana (and PrometheusRules) query."""
    names: set[str] = set()
    for _, text in promql_expressions() + dashboard_variable_queries():
        names |= metric_names_in(text)
    return names
